"""What a request returns: `Result` with its `Stats`. Small frozen values that cross module boundaries."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Stats:
    """Per-request numbers. `reused_tokens + prefilled_tokens == prompt_tokens`."""

    prompt_tokens: int
    reused_tokens: int
    prefilled_tokens: int
    generated_tokens: int
    ttft_s: float
    decode_tok_s: float
    total_s: float
    backend: str
    device: str
    chunk_size: int | None = None
    draft_tokens: int = 0  # speculative decoding: tokens proposed (prompt lookup) and verified
    accepted_tokens: int = 0  # of those, the ones kept (each saved a forward)

    @property
    def reused_fraction(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def line(self) -> str:
        """One human line: `[ 613 in · 598 reused (98%) · 15 prefilled · 64 out · ttft 41 ms · 38.2 tok/s ]`,
        with `· 40/52 drafts kept` before the backend when speculative decoding proposed any."""
        drafts = f" · {self.accepted_tokens}/{self.draft_tokens} drafts kept" if self.draft_tokens else ""
        return (
            f"[ {self.prompt_tokens} in · {self.reused_tokens} reused ({self.reused_fraction:.0%}) · "
            f"{self.prefilled_tokens} prefilled · {self.generated_tokens} out · "
            f"ttft {self.ttft_s * 1000:.0f} ms · {self.decode_tok_s:.1f} tok/s{drafts} · {self.backend}/{self.device} ]"
        )


@dataclass(frozen=True)
class Result:
    """A finished generation.

    `text` excludes EOS and stop strings; `tokens` are the generated ids, including the EOS that
    ended generation; `finish_reason` is "stop" (EOS or a stop string), "length" or "tool_calls";
    `logits` (when asked) holds the raw float32 logits of each generated step before any processor,
    `[n, vocab]`. With tools, `tool_calls` are the parsed calls (`onnxgen.text.tools.ToolCall`) and
    `content` the text around them (None when there is none); without, `content` is `text`.
    """

    text: str
    tokens: list[int]
    finish_reason: str
    stats: Stats
    prompt_ids: list[int] = field(repr=False, default_factory=list)
    logits: Any = field(repr=False, default=None)
    tool_calls: list[Any] = field(default_factory=list)
    content: str | None = None

    def __post_init__(self) -> None:
        if self.content is None and not self.tool_calls:
            object.__setattr__(self, "content", self.text)
