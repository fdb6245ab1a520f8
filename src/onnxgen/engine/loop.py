"""The one decode loop, over the Decoder protocol: prefill (chunked) → sample → stop → stream.

The loop never looks inside a backend: it feeds tokens at increasing positions, samples from the
returned logits (numpy or torch; see `onnxgen.sampling`) and decides when to stop. It does not
decide reuse: it starts at `start_pos`, the number of prompt tokens the cache already holds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from onnxgen.backends.base import Decoder
from onnxgen.errors import Cancelled
from onnxgen.sampling import Sampler

TokenCallback = Callable[[str], Any]


@dataclass(frozen=True)
class LoopOutput:
    """What the loop produced. `fed` is how many positions the cache holds at the end."""

    text: str
    tokens: list[int]
    finish_reason: str
    fed: int
    ttft_s: float
    decode_s: float
    logits: np.ndarray | None


def plan_chunks(start: int, end: int, chunk_size: int | None) -> list[tuple[int, int]]:
    """Split positions [start, end) into prefill chunks of at most `chunk_size` (None: one chunk)."""
    assert 0 <= start < end
    if not chunk_size or chunk_size >= end - start:
        return [(start, end)]
    return [(s, min(s + chunk_size, end)) for s in range(start, end, chunk_size)]


class _StopScanner:
    """Finds stop strings in streamed text, holding back text that may be the start of one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.text = ""
        self.emitted = 0

    def feed(self, piece: str) -> tuple[str, bool]:
        """Add `piece`; return (text safe to emit now, stopped)."""
        self.text += piece
        if self.stops:
            window = max(0, self.emitted - max(len(s) for s in self.stops))
            hits = [i for i in (self.text.find(s, window) for s in self.stops) if i >= 0]
            if hits:
                cut = min(hits)
                out = self.text[self.emitted : max(cut, self.emitted)]
                self.text = self.text[:cut]
                self.emitted = len(self.text)
                return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        upto = max(len(self.text) - hold, self.emitted)
        out = self.text[self.emitted : upto]
        self.emitted = upto
        return out, False

    def flush(self) -> str:
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out


def _to_host(logits: Any) -> np.ndarray:
    if isinstance(logits, np.ndarray):
        return logits.astype(np.float32, copy=True)
    return logits.detach().float().cpu().numpy()


def run(
    decoder: Decoder,
    prompt: Sequence[int],
    start_pos: int,
    sampler: Sampler,
    *,
    detokenizer: Any,
    max_new_tokens: int,
    context_length: int,
    eos_ids: Sequence[int],
    stop: Sequence[str] = (),
    chunk_size: int | None = None,
    inputs: Mapping[str, Any] | None = None,
    on_token: TokenCallback | None = None,
    output_logits: bool = False,
    cancel: threading.Event | None = None,
) -> LoopOutput:
    """Generate after `prompt`, whose first `start_pos` tokens are already in the cache.

    Raises whatever the decoder or callback raises (the caller drops the cache), and `Cancelled`
    when `cancel` is set. Stops on EOS, a stop string, `max_new_tokens`, or the context length.
    """
    assert 0 <= start_pos < len(prompt), "at least one prompt token must be computed"
    t0 = time.perf_counter()
    logits: Any = None
    for s, e in plan_chunks(start_pos, len(prompt), chunk_size):
        if cancel is not None and cancel.is_set():
            raise Cancelled("generation cancelled during prefill")
        logits = decoder.forward(prompt[s:e], s, inputs)
    pos = len(prompt)
    eos = set(eos_ids)
    scanner = _StopScanner(stop)
    tokens: list[int] = []
    raw: list[np.ndarray] = []
    finish = "length"
    stopped = False
    ttft = 0.0
    t_first = t0
    while True:
        if output_logits:
            raw.append(_to_host(logits))
        token = sampler.sample(logits)
        tokens.append(token)
        if len(tokens) == 1:
            t_first = time.perf_counter()
            ttft = t_first - t0
        if token in eos:
            finish = "stop"
            break
        piece, stopped = scanner.feed(detokenizer.push(token))
        if piece and on_token is not None:
            on_token(piece)
        if stopped:
            finish = "stop"
            break
        # prompt + generated may not exceed the context length; the next feed is at position `pos`.
        if len(tokens) >= max_new_tokens or pos + 1 >= context_length:
            break
        if cancel is not None and cancel.is_set():
            raise Cancelled("generation cancelled")
        logits = decoder.forward([token], pos, inputs)
        pos += 1
    if not stopped:
        tail, stopped = scanner.feed(detokenizer.flush())
        if stopped:
            finish = "stop"
        else:
            tail += scanner.flush()
        if tail and on_token is not None:
            on_token(tail)
    decode_s = time.perf_counter() - t_first
    return LoopOutput(
        text=scanner.text,
        tokens=tokens,
        finish_reason=finish,
        fed=pos,
        ttft_s=ttft,
        decode_s=decode_s,
        logits=np.stack(raw) if output_logits else None,
    )
