"""One mutable record per request, and what happens to it when a token is sampled.

    prompt    p0 p1 p2 p3 p4            output  o0 o1 o2
    tokens    p0 p1 p2 p3 p4 o0 o1 o2   (prompt + output)
    computed  ------------------^        positions whose KV is in the cache (7): o2 was sampled, not fed

Each engine step feeds a request `tokens[computed : computed + n]` (a prefill chunk, or the one token a
decode step feeds) and, when that reaches the end of `tokens`, samples the next token from the last
position's logits (`Request.accept`). A request finishes on EOS, a stop string, `max_new_tokens` or the
context length; its KV then covers `tokens[:computed]` = the prompt and every generated token but the
last (docs/reuse.md, invariant 3).

The record is the engine's: the scheduler, the KV adapters and the step read and change it, always from
the thread that holds the engine's step. The submitting thread waits on `done` and reads the outcome.
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onnxgen.sampling import Sampler, sample_rows

TokenCallback = Callable[[str], Any]


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted (its KV was dropped; it is recomputed)
    RUNNING = "running"  # holds KV; scheduled every step until it finishes
    FINISHED = "finished"


class StopScanner:
    """Finds stop strings in streamed text, holding back text that may be the start of one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.text = ""
        self.emitted = 0

    def feed(self, piece: str) -> tuple[str, bool]:
        """Add `piece`; return (text safe to emit now, stopped)."""
        if not self.stops:  # nothing to hold back
            if piece:
                self.text += piece
                self.emitted = len(self.text)
            return piece, False
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


def to_host(logits: Any) -> np.ndarray:
    """A float32 host copy of one position's logits (numpy or torch)."""
    if isinstance(logits, np.ndarray):
        return logits.astype(np.float32, copy=True)
    return logits.detach().float().cpu().numpy()


_ids = itertools.count(1)


@dataclass(eq=False)
class Request:
    """A request in flight. `digest` is its identity digest (None: undigestable, shares and keeps
    nothing); `reuse=False` neither matches nor commits any cached KV."""

    prompt: list[int]
    digest: bytes | None
    sampler: Sampler
    detokenizer: Any
    max_new_tokens: int
    context_length: int
    eos_ids: frozenset[int]
    stop: Sequence[str] = ()
    inputs: Mapping[str, Any] | None = None
    on_token: TokenCallback | None = None
    output_logits: bool = False
    cancel: threading.Event | None = None
    reuse: bool = True
    chunk_size: int | None = None
    owner: Any = None  # the session that keeps this request's context on success, or None
    held: Any = None  # the owner's retained state, taken for this request (docs/reuse.md, invariant 2)
    kept: Any = None  # after success: the state the owner keeps (its decoder, or a pin on its context)
    drafts: Any = None  # a `drafts.DraftControl` when the request decodes speculatively, else None
    tools: Sequence[Mapping[str, Any]] | None = None  # the tool definitions its text is parsed for
    tool_choice: Any = None
    on_done: Callable[[Request], None] | None = (
        None  # called once when it finishes or fails (the engine's thread)
    )

    id: int = field(default_factory=lambda: next(_ids))
    output: list[int] = field(default_factory=list)
    computed: int = 0
    cached: int = 0  # prompt positions the cache supplied at the first admission
    admissions: int = 0  # 1 + times it was preempted and admitted again
    kv: Any = None  # the KV adapter's per-request state (a page table, or a decoder)
    # set by the KV adapter on admission: the length its KV may reach before it must be computed anew (LongRoPE:
    # keys computed with the short rotary factors are valid up to the switch; the scheduler then recomputes the
    # request, `Scheduler._recompute`); None: no such length
    kv_limit: int | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: BaseException | None = None
    logits: list[np.ndarray] = field(default_factory=list)
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0
    t_done: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        assert self.prompt, "a request has at least one prompt token"
        self._scanner = StopScanner(self.stop)

    # --- positions ---------------------------------------------------------------------------------

    @property
    def tokens(self) -> list[int]:
        """Prompt + output: every token whose KV is or will be computed."""
        return self.prompt + self.output if self.output else self.prompt

    def token_slice(self, start: int, n: int) -> list[int]:
        """`tokens[start : start + n]` without building `tokens` (a decode step reads one token)."""
        lp = len(self.prompt)
        if start >= lp:
            return self.output[start - lp : start - lp + n]
        if start + n <= lp:
            return self.prompt[start : start + n]
        return self.prompt[start:] + self.output[: start + n - lp]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def pending(self) -> int:
        """Tokens to feed before the next sample."""
        return self.num_tokens - self.computed

    @property
    def text(self) -> str:
        return self._scanner.text

    @property
    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    # --- sampling ----------------------------------------------------------------------------------

    def accept(self, logits: Any, token: int | None = None) -> bool:
        """Sample the next token from the last fed position's `logits` (or take `token`, chosen for this
        request by a batched call, `sampling.sample_rows`), stream its text, and decide whether the
        request is finished (then `finish_reason` is set). Returns True when finished. Raises what a
        processor or the `on_token` callback raises."""
        if self.output_logits:
            self.logits.append(to_host(logits))
        if token is None:
            token = self.sampler.sample(logits)
        else:
            self.sampler.accept(token)
        self.output.append(token)
        if len(self.output) == 1:
            self.t_first = time.perf_counter()
        if token in self.eos_ids:
            return self._finish("stop")
        piece, stopped = self._scanner.feed(self.detokenizer.push(token))
        if piece and self.on_token is not None:
            self.on_token(piece)
        if stopped:
            return self._finish("stop", flushed=True)
        # prompt + generated may not exceed the context length: the next feed is at position num_tokens - 1
        if len(self.output) >= self.max_new_tokens or self.num_tokens >= self.context_length:
            return self._finish("length")
        return False

    def accept_drafted(self, rows: Any, draft: Sequence[int]) -> tuple[bool, int]:
        """Verify `draft` (fed after the last sampled token) with `rows`, the logits of those
        `len(draft) + 1` positions: sample each row in order exactly as plain decoding would, and stop
        after the first sample that differs from its draft (or that finishes the request). Returns
        (finished, samples taken); the samples are in `output`, and the cache's valid positions end
        after the fed tokens that match them (the caller rewinds past the rest). Raw choices are made for
        every row at once (`Sampler.choose_ahead`: one device round trip, not one per row)."""
        n = len(draft) + 1
        chosen = None if self.sampler.needs_processing else self.sampler.choose_ahead(rows[:n])
        taken, finished = 0, False
        while not finished and taken < n:  # every draft kept: the row after the last gives the next token too
            finished = self.accept(rows[taken], None if chosen is None else chosen[taken])
            taken += 1
            if taken < n and self.output[-1] != draft[taken - 1]:
                break
        return finished, taken

    def _finish(self, reason: str, flushed: bool = False) -> bool:
        self.finish_reason = reason
        if not flushed:
            tail, stopped = self._scanner.feed(self.detokenizer.flush())
            if stopped:
                self.finish_reason = "stop"
            else:
                tail += self._scanner.flush()
            if tail and self.on_token is not None:
                self.on_token(tail)
        return True

    # --- the outcome -------------------------------------------------------------------------------

    @property
    def fed(self) -> list[int]:
        """The tokens whose KV the cache holds when the request has finished: all but the last sample."""
        return self.tokens[: self.num_tokens - 1] if self.output else self.tokens[: self.computed]

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)


def sample_chunks(chunks: Sequence[Any], outs: Sequence[Any], rows: Sequence[int]) -> dict[int, Any]:
    """The chosen token of each row in `rows` (indices into `chunks`, a step's `scheduler.Chunk`s; `outs`: their
    logits), or the exception its processors raised (that request alone fails)."""
    ok: list[int] = []
    picked: dict[int, Any] = {}
    for i in rows:
        sampler = chunks[i].req.sampler
        if sampler.needs_processing:
            try:
                outs_i = sampler.process(outs[i])
            except Exception as exc:
                picked[i] = exc
                continue
            picked[i] = outs_i  # processed logits, chosen below
        ok.append(i)
    logits = [picked.get(i, outs[i]) for i in ok]
    tokens = sample_rows([chunks[i].req.sampler for i in ok], logits, processed=True)
    picked.update(zip(ok, tokens, strict=True))
    return picked
