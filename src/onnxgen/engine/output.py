"""What a request returns: `Result` with its `Stats` (small frozen values that cross module boundaries), and
`result_of`, which assembles them from a finished request (tool calls parsed out of its text).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from onnxgen.engine.request import Request


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


def result_of(req: Request, *, backend: str, device: str, chunk_size: int | None, tool_format: Any) -> Result:
    """The `Result` of a finished request (`req.error is None`). Its prepared tools (unless `tool_choice`
    is "none") are parsed out of the text by `tool_format`: with calls, `finish_reason` is "tool_calls"
    (unless `max_new_tokens` cut the output short: "length", the complete calls kept) and `content` the text
    around them; output that starts a call (the tool grammar's call region) has no content, so a call cut
    short leaves no markup in it."""
    n = len(req.output)
    decode_s = req.t_done - req.t_first
    t0 = req.t_submit
    stats = Stats(
        prompt_tokens=len(req.prompt),
        reused_tokens=req.cached,
        prefilled_tokens=len(req.prompt) - req.cached,
        generated_tokens=n,
        ttft_s=req.t_first - t0,
        decode_tok_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
        total_s=req.t_done - t0,
        backend=backend,
        device=device,
        chunk_size=chunk_size,
        draft_tokens=req.drafts.drafted if req.drafts is not None else 0,
        accepted_tokens=req.drafts.accepted if req.drafts is not None else 0,
    )
    content: str | None = req.text
    calls: Sequence[Any] = []
    finish = req.finish_reason or "stop"
    if req.tools and req.tool_choice != "none":
        content, calls = tool_format.parse(req.text)
        if req.text[:1] == tool_format.marker[:1]:  # the grammar's call region: all of it is call markup
            content = None
        if calls and finish == "stop":
            finish = "tool_calls"
    return Result(
        text=req.text,
        tokens=list(req.output),
        finish_reason=finish,
        stats=stats,
        prompt_ids=req.prompt,
        logits=np.stack(req.logits) if req.output_logits else None,
        tool_calls=list(calls),
        content=content,
    )


class Handle:
    """A submitted request (`Model.submit`, `Session.submit`). `result(timeout)` waits for its `Result` and
    raises what it failed with (`Cancelled`, a backend error ...); `cancel()` stops it at its next step;
    `future` is a `concurrent.futures.Future` of the Result, for `asyncio.wrap_future` (no thread waits)."""

    def __init__(self, cancel: threading.Event | None = None) -> None:
        self.future: Future[Result] = Future()
        self.cancel_event = cancel if cancel is not None else threading.Event()

    def cancel(self) -> None:
        """Stop the request at its next step (or before it starts); its `result()` then raises `Cancelled`."""
        self.cancel_event.set()

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> Result:
        """The `Result`; raises what the request failed with, or `TimeoutError` after `timeout` seconds. An
        interrupt (Ctrl-C) while waiting cancels the request."""
        try:
            return self.future.result(timeout)
        except KeyboardInterrupt:
            self.cancel()
            raise

    def set_result(self, result: Result) -> None:
        self.future.set_result(result)

    def set_error(self, exc: BaseException) -> None:
        self.future.set_exception(exc)
