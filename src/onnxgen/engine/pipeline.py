"""Decode runs: several decode steps launched back to back, tokens chosen on the device, read behind them.

With paged KV a step whose chunks are all plain decodes (no processors, penalties, kept logits or drafts)
can run `decode_steps` of them at once (`PagedKV.launch_decodes`): the device chooses each step's tokens
and feeds them to the next, and the host reads the tokens after the run was launched. While the batch can
go on, the next run is launched before the current one is read, so the device never waits for the host:

    launch(run 0) ─ launch(run 1) ─ take(run 0) ─ launch(run 2) ─ take(run 1) ─ ...   (one in flight ahead)

A prompt's last chunk can launch its request's first run behind the device's choice of its first token,
before the host reads that token (`launch_first`): no host round trip between prefill and decoding.

Each request takes a run's tokens in order exactly as single steps would (EOS, stop strings and lengths
checked per token); positions fed after a request finished are taken back out of its cache. Once a request
finishes or fails, the run already launched is taken by the others and control returns to the engine's
step. A run that only finished requests fed is nobody's to read: it is the pipeline's one piece of state
across steps, `tail` (an `InFlight`); the next step, or `settle`, waits for it — not the finished requests'
callers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from onnxgen.engine.request import Request, Status
from onnxgen.engine.scheduler import Chunk, Scheduler


@dataclass(frozen=True)
class RunPolicy:
    """How long runs are. `decode_steps`: steps per run (1: no runs). `spec_decode_steps`: at most this many
    while a request of the run copies from its context or confirms a match (`DraftControl.watching`).
    `launch_first`: launch a prompt's first run behind its prefill step; `first_run_steps`: that run's
    steps (0: `decode_steps`)."""

    decode_steps: int
    spec_decode_steps: int
    launch_first: bool
    first_run_steps: int


@dataclass(frozen=True)
class InFlight:
    """A launched run of decode steps of `chunks` whose tokens are not all taken: the executor's handle,
    launched at `offset` steps past the chunks' starts."""

    chunks: Sequence[Chunk]
    handle: Any
    offset: int


class DecodePipeline:
    """The engine's decode runs over a paged executor (`engine/paged.PagedKV`). `finish` / `fail` are the
    engine's: they end a request (and remove it from the scheduler). Used from the engine's step only."""

    def __init__(
        self,
        executor: Any,
        scheduler: Scheduler,
        policy: RunPolicy,
        *,
        paged: bool,
        finish: Callable[[Request], None],
        fail: Callable[[Request, BaseException], None],
    ) -> None:
        self.executor = executor
        self.scheduler = scheduler
        self.policy = policy
        self.paged = paged
        self._finish = finish
        self._fail = fail
        self.tail: InFlight | None = (
            None  # a launched run nobody reads: the next step (or `settle`) waits for it
        )

    # --- how many steps -------------------------------------------------------------------------------

    def run_length(self, chunks: Sequence[Chunk]) -> int:
        """How many decode steps to run back to back now (1: an ordinary step). More than one only when the
        KV is paged, every chunk is a plain decode whose choice needs nothing of the host (no processors or
        penalties, no logits kept, no drafts), and no waiting request could be admitted meanwhile; at most
        `_steps` and what every request may still generate; pages for them all reserved (else 1)."""
        k = self._steps(chunks)
        if k <= 1 or not self.paged or self._admissible():
            return 1
        for c in chunks:
            r = c.req
            if c.n != 1 or not c.sample or c.draft or r.output_logits or r.sampler.needs_processing:
                return 1
        return self._room(chunks, k, 0, least=2) or 1

    def first_run_length(self, chunks: Sequence[Chunk]) -> tuple[int, list[Chunk]]:
        """How many decode steps to launch right behind a step of prompts' last chunks (0: none), and those
        chunks as decodes of their last prompt position (whose step chooses the first token, so runs continue
        from there at offset 1). Some only when each chunk ends its prompt and samples its request's first
        token, and the request could then decode in runs (as `run_length`), with `launch_first`; at most
        `decode_steps` (and `first_run_steps`) and what each request may still generate after that first
        token. Reserves the pages."""
        k = self.policy.decode_steps
        if k <= 1 or not (self.paged and self.policy.launch_first) or self._admissible():
            return 0, []
        k = min(k, self.policy.first_run_steps or k)
        for c in chunks:
            r = c.req
            if (
                not c.sample
                or c.draft
                or r.output
                or r.cancelled
                or r.output_logits
                or r.sampler.needs_processing
                or (r.drafts is not None and r.drafts.active(len(chunks)))
            ):
                return 0, []
        decodes = [Chunk(c.req, c.start + c.n - 1, 1, True) for c in chunks]
        return self._room(decodes, k, 1), decodes

    def _steps(self, chunks: Sequence[Chunk]) -> int:
        """Steps per run for `chunks`: `decode_steps`, at most `spec_decode_steps` when one of them is copying
        or has a match waiting to be confirmed by the next run (`DraftControl.watching`)."""
        if any(
            c.req.drafts is not None
            and c.req.drafts.active(len(chunks))
            and c.req.drafts.watching(len(c.req.output))
            for c in chunks
        ):
            return min(self.policy.decode_steps, self.policy.spec_decode_steps)
        return self.policy.decode_steps

    def _admissible(self) -> bool:
        """Whether a waiting request could be admitted now (a run of decode steps would keep it waiting)."""
        sch = self.scheduler
        return bool(sch.num_waiting()) and len(sch.running) < sch.max_running

    def _room(self, chunks: Sequence[Chunk], k: int, fed: int, least: int = 1) -> int:
        """At most `k` decode steps for `chunks` after the `fed` steps already launched or chosen for them:
        what every request may still generate, those steps counted, its context and its `kv_limit` hold; with
        the pages for them all reserved, or 0 when fewer than `least` fit."""
        for c in chunks:
            r = c.req
            unread = c.start + fed - r.num_tokens + 1  # launched steps whose tokens the request has not taken
            k = min(k, r.max_new_tokens - len(r.output) - unread, r.context_length - (c.start + fed) - 1)
            if r.kv_limit is not None:  # no step past the length its KV is valid for (`Request.kv_limit`)
                k = min(k, r.kv_limit - (c.start + fed))
        if k >= least and all(self.executor.reserve(c.req, c.start + fed + k) for c in chunks):
            return k
        return 0

    def _continue(self, chunks: Sequence[Chunk], fed: int) -> int:
        """How many decode steps to launch after the `fed` steps already launched for `chunks` (0: none): as
        `run_length`, counting the launched steps as generated, and none once a request is cancelled or a
        waiting request could be admitted. Reserves the pages."""
        if self._admissible() or any(c.req.cancelled for c in chunks):
            return 0
        return self._room(chunks, self._steps(chunks), fed)

    # --- the two verbs ----------------------------------------------------------------------------------

    def launch(
        self, chunks: Sequence[Chunk], k: int, offset: int = 0, after: InFlight | Any = None
    ) -> InFlight:
        """Enqueue `k` decode steps of `chunks` at `offset` past their starts; `after`: a launched run (or a
        prompt's first-token choice) they continue from. Raises what the executor raises."""
        inner = after.handle if isinstance(after, InFlight) else after
        return InFlight(chunks, self.executor.launch_decodes(chunks, k, offset, inner), offset)

    def take(self, run: InFlight, done: set[int]) -> tuple[set[int], bool]:
        """Read `run` part by part as the device completes them, the requests not in `done` taking each
        part's tokens, until all are done: a reply that ends in a run's first part returns without waiting for
        the rest, which becomes `tail`. Returns (done, whether the run could be read; if not, the requests not
        done failed)."""
        parts = self.executor.decode_parts(run.handle)
        got = 0
        for end in parts:
            try:
                rows = self.executor.collect_decodes(run.handle, end)
            except Exception as exc:
                for i, c in enumerate(run.chunks):
                    if i not in done:
                        self._fail(c.req, exc)
                return done, False
            done = self._take_rows(run.chunks, rows[got:], run.offset + got, done, parts[-1] - got)
            got = end
            if len(done) == len(run.chunks):
                if got < parts[-1]:  # the rest of the run: the next step's to wait for
                    self.tail = run
                break
        return done, True

    def _take_rows(
        self, chunks: Sequence[Chunk], rows: list[list[int]], offset: int, done: set[int], fed: int = 0
    ) -> set[int]:
        """Each request of `chunks` not in `done` takes the rows' tokens (`rows[j][i]`, fed at positions
        `start + offset + j`; `fed`: how many positions the run fed from `offset`, if more than the rows)
        until it finishes, the positions fed past its end taken back out; finished and failed requests join
        `done` (returned)."""
        k = len(rows)
        fed = max(fed, k)
        for i, c in enumerate(chunks):
            if i in done:
                continue
            req = c.req
            taken, finished = 0, False
            try:
                while taken < k and not finished:
                    finished = req.accept(None, rows[taken][i])
                    taken += 1
                req.computed = c.start + offset + taken
                if finished and taken < fed:
                    self.executor.discard(req, req.computed)
            except Exception as exc:  # a processor, the on_token callback, or the rewind
                self._fail(req, exc)
                done.add(i)
                continue
            if finished:
                self._finish(req)
                done.add(i)
        return done

    # --- chains ---------------------------------------------------------------------------------------------

    def run(self, chunks: Sequence[Chunk], k: int) -> None:
        """Runs of decode steps of `chunks`, `k` first (see the module doc)."""
        try:
            run = self.launch(chunks, k)
        except Exception as exc:  # the run failed: every request in it fails
            for c in chunks:
                self._fail(c.req, exc)
            return
        self._chain(run, k)

    def _chain(self, run: InFlight, k: int) -> None:
        """Take `run` (its `k` steps launched) and the runs after it, each launched before the one before it is
        read, while the batch may continue; ends where a request finished or failed (the others take the run
        already launched too), where one wants its drafts verified, or where nothing more may be launched."""
        chunks = run.chunks
        while True:
            fed = run.offset + k
            k_next = self._continue(chunks, fed)
            nxt = None
            if k_next:
                try:
                    nxt = self.launch(chunks, k_next, fed, run)
                except Exception:  # not launched: this run ends the chain (a real fault recurs in `step`)
                    nxt = None
            done, ok = self.take(run, set())
            if not ok:
                self._drain(nxt)
                return
            if nxt is None:
                return
            if len(done) == len(
                chunks
            ):  # all finished: the launched run's steps lie past every context, and its
                # wait is left to the next step (this run's unread part is ordered before it), so the finished
                # requests' callers return now (a reply that ends by EOS stops inside a chain)
                self.tail = nxt
                return
            if done or self.drafts_ready(chunks, done, k_next):  # the others take the launched run's tokens
                # too, then `step` schedules anew (a request that found drafts verifies them there)
                self.take(nxt, done)
                return
            run, k = nxt, k_next

    @staticmethod
    def drafts_ready(chunks: Sequence[Chunk], done: set[int], unread: int) -> bool:
        """Whether to stop a chain of runs (the run just read taken, `unread` steps launched behind it) so that
        `step` verifies drafts: a speculating request of the run, not in `done`, that will still have room for
        a draft once it has taken the launched steps' tokens, asks for it (`DraftControl.stop_chain`)."""
        for i, c in enumerate(chunks):
            r = c.req
            if i in done or r.drafts is None or not r.drafts.active(len(chunks)):
                continue
            left = min(r.max_new_tokens - len(r.output), r.context_length - r.num_tokens) - unread
            if left >= 2 and r.drafts.stop_chain(r.prompt, r.output):  # a sample and at least one draft
                return True
        return False

    # --- a prompt's first run ---------------------------------------------------------------------------------

    def launch_first(
        self, decodes: list[Chunk], outs: Sequence[Any], k: int
    ) -> tuple[list[int], InFlight | None] | None:
        """Choose the prompts' first tokens on the device (`outs`: their logits rows), launch `k` decode steps
        of `decodes` behind them, then read the tokens (the host's one wait: the device decodes meanwhile):
        (tokens, the run or None if its launch failed), or None where nothing was chosen (the step goes on as
        it would have)."""
        try:
            first = self.executor.choose_first(decodes, outs)
        except Exception:  # chosen as usual by the step (a real fault recurs there)
            return None
        try:
            run: InFlight | None = self.launch(decodes, k, 1, first)
        except Exception:  # not launched: the requests decode from the next step (a real fault recurs there)
            run = None
        return self.executor.chosen(first), run

    def continue_first(self, run: InFlight | None, k: int) -> None:
        """After the prompts' first tokens were taken, the run launched behind them: decode runs go on from it as
        `run`'s; taken by the others and ended where a request finished or failed at its first token; left as
        `tail` where all did."""
        if run is None:
            return
        done = {i for i, c in enumerate(run.chunks) if c.req.status is Status.FINISHED}
        if len(done) == len(run.chunks):
            self.tail = run
            return
        if done:  # some requests finished at their first token: the others take this run, then `step` schedules anew
            self.take(run, done)
            return
        self._chain(run, k)

    # --- the tail ----------------------------------------------------------------------------------------------

    def settle(self) -> None:
        """Wait for `tail` (a run nobody reads; its steps wrote keys only past their contexts, and anything
        launched after it is ordered behind it on the device)."""
        run, self.tail = self.tail, None
        self._drain(run)

    def _drain(self, run: InFlight | None) -> None:
        """Wait for a launched run whose tokens nobody takes (its positions lie past every context)."""
        if run is not None:
            with contextlib.suppress(Exception):  # already failing: the caller reports the first error
                self.executor.collect_decodes(run.handle)
