"""The batched seam: what the engine's scheduler hands a batched runner each step, as plain data.

A step is a flattened ragged batch: several sequences, each contributing the tokens it feeds this step
(a decode step feeds one, a prefill chunk many) at consecutive positions starting at `start`, with the
page table that maps its positions to KV slots (position p -> page `pages[p // page_size]`, offset
`p % page_size`). The runner writes the new tokens' keys and values at their slots, attends each token
over its own sequence's positions `[0, p]`, and returns the logits of the last token of every chunk
that asks for them, in batch order.

    step = BatchStep((SeqChunk(tokens=[5, 9, 2], start=0, pages=[7], logits=True),     # a prompt
                      SeqChunk(tokens=[44], start=130, pages=[1, 2, ..., 9], logits=True)))  # a decode
    logits = runner.run(step)            # [2, vocab] float32 on the runner's device

The runner never sees requests, sessions or the prefix index; the scheduler never sees tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol


class SeqChunk(NamedTuple):
    """One sequence's part of a step: `tokens` at positions `[start, start + len(tokens))`; `pages` cover
    at least `start + len(tokens)` positions; `logits`: how many of the last tokens' logits to return
    (0 / False: none; 1 / True: the last token's; more: to verify draft tokens). `total`: the length the
    sequence is computed for when larger than `end` (a prompt's chunk before its last: the prompt's length),
    which a graph sees as its attention mask's width: LongRoPE's rotary regime follows it (0: `end`)."""

    tokens: Sequence[int]
    start: int
    pages: Sequence[int]
    logits: int = 1
    total: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(frozen=True)
class BatchStep:
    seqs: tuple[SeqChunk, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.seqs)

    @property
    def num_logits(self) -> int:
        return sum(int(s.logits) for s in self.seqs)


@dataclass
class DeviceTokens:
    """Tokens chosen on the device and not read by the host yet: `toks` `[k, B]` int64 (a launched run's
    steps, or one row: a step's sampled rows chosen on the device). `launch_decodes(after=...)` continues
    from the last row."""

    toks: Any


class BatchRunner(Protocol):
    """A model that runs ragged batches over a paged KV pool it owns (`storage`, `page_size`,
    `num_pages`). `run` raises on failure; the KV of the step's positions is then unspecified (the
    scheduler drops the requests, so nothing of them is ever indexed)."""

    backend: str
    device: str
    page_size: int
    num_pages: int
    storage: Any
    verify_sizes: tuple[int, ...]
    """The sizes a verify step of n positions costs as: the smallest one >= n (a step padded to it);
    () where a step costs what its positions do."""
    rope_switch: int | None
    """LongRoPE: a sequence's keys are computed with the long rotary factors when its `total` exceeds this,
    else with the short ones (None: no switch). Keys computed in one regime are not valid in the other: the
    caller recomputes a sequence whose length crosses it (no chunk crosses it unless it starts at 0)."""
    kv_window: int
    """The sliding window every layer attends within (0: some layer reads the whole context): a step whose
    first query of a sequence is at position p reads none of its keys below p - kv_window + 1, so their
    page table entries may be holes (`kv.manager.HOLE`). Optional (read with a default of 0)."""

    def run(self, step: BatchStep) -> Any: ...

    def launch_decodes(self, step: BatchStep, k: int, choose: Any, offset: int = 0, after: Any = None) -> Any:
        """Enqueue `k` decode steps of `step`'s sequences (one token each) back to back, each step's tokens
        chosen on the device by `choose(logits [B, vocab], offset + j) -> [B] int64` and fed to the next
        without a host round trip; `pages` cover `start + k` positions. `after` (`DeviceTokens`): a run
        launched before, or a prefill's choice made on the device, whose last tokens are this run's first ids
        (`step`'s tokens are then placeholders), so a run can be enqueued before the previous tokens are read.
        Returns a handle for `collect_decodes`. Raises as `run`."""
        ...

    def stage_tokens(self, toks: Any) -> Any:
        """A handle for `collect_decodes` over tokens already chosen on the device (`[k, B]` int64, a
        `DeviceTokens`): their copy to the host is enqueued now, so collecting them waits for the work
        enqueued before this call only, not for what is launched after it."""
        ...

    def decode_parts(self, run: Any) -> tuple[int, ...]:
        """How a launched run's rows reach the host: increasing row counts, the last = its steps; the rows up
        to each are readable (`collect_decodes(run, rows)`) without waiting for the steps after them."""
        ...

    def collect_decodes(self, run: Any, rows: int | None = None) -> list[list[int]]:
        """The first `rows` (default: all `k`) of a launched run's `[k][B]` tokens; waits for the part that
        holds them only (the caller's one synchronisation per part)."""
        ...
