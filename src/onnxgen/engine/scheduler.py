"""The scheduler: which requests feed which tokens in the next engine step.

Each step has a token budget (`max_batch_tokens`). Chunked prefill is the scheduler's: a request's prompt is
fed over several steps in chunks of at most `chunk_size` (the request's) and of its share of the budget.
The budget goes, in this order (`prefill_policy="fair"`, the default):

1. decodes: every running request past its prompt feeds its one token (and its drafts), so that requests
   already streaming keep their pace whatever arrives;
2. running prefills, within a share: all that is left, or half of it while requests wait that could be
   admitted (the other half is theirs). The oldest prefill (by arrival: a preempted request keeps its age)
   goes first, so it always progresses (half of the share when other prefills run beside it); the others
   go shortest-left first, so a short prompt is not held behind a long one;
3. admissions: waiting requests in arrival order while the budget and `max_running` allow, each starting
   with a prefill chunk. A request the KV adapter defers (it will share pages a running request is still
   computing: agents under one system prompt wait for the first to compute it) keeps its place and takes
   nothing, and later arrivals may pass it; the deferred ones are admitted together the step after the
   pages they share are computed;
4. top-up: budget the admissions left goes back to the running prefills in the order of 2 (no budget is
   left unused while a prompt wants it).

    budget 8, running A (decode), B (prefill, 9 pending), waiting C (5)
    step:  A 1 | B 4 (its half of 7) | C 3                  (C admitted beside B's prefill)
    next:  A 1 | B 5 (sampled)| C 2 (sampled)                (B oldest: its chunk first)

This is vLLM's and SGLang's shape of chunked prefill (decode first, long prefills chunked so that short
prompts pass them) with no starvation: the oldest prefill gets at least a quarter of a step's prefill
tokens and arrivals at least half. `prefill_policy="fifo"` is the plain order: running prefills in
admission order, each taking what is left, then admissions first come first served.

KV comes from a `KVAdapter` (a paged pool, or one decoder per request). When it cannot supply the
positions a running request needs, the most recently admitted running request is preempted: its KV is
released and it waits again at the head of the queue, to be recomputed (its generated tokens are kept).
A waiting request that cannot be admitted waits; nothing fails for lack of memory. With preemption off
(per-request decoders) requests are only ever admitted when they fit.

A request's KV may be valid only up to a length (`Request.kv_limit`: LongRoPE's switch, for keys computed
with the short rotary factors): no chunk or draft is fed past it; the step that would is replaced by the
request's recomputation (`_recompute`), admitted again at once where there is room.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import NamedTuple, Protocol

from onnxgen.engine.request import Request, Status


class KVAdapter(Protocol):
    """Where a request's KV comes from. Every call is made by the engine's step (one thread)."""

    def admit(self, req: Request) -> bool:
        """Attach KV to `req` (reusing what the cache holds): sets `req.kv` and `req.computed`. False,
        with nothing changed, when there is no room now."""

    def reserve(self, req: Request, total: int) -> bool:
        """Room for positions [0, total) of an admitted request. False, with nothing changed, if none."""

    def release(self, req: Request) -> None:
        """Drop the request's KV (preemption or failure): nothing of it stays visible."""

    def defer(self, req: Request) -> bool:
        """Whether a waiting request should stay waiting this step although it could be admitted (a
        running request is computing KV it will share); later requests may be admitted meanwhile."""


class Chunk(NamedTuple):
    """`req` feeds `tokens[start : start + n]` this step; `sample`: the chunk reaches the end of the
    request's tokens, so the next token is sampled from its last position. `draft`: tokens proposed to
    follow them (speculative decoding), fed after them in the same forward and verified by sampling."""

    req: Request
    start: int
    n: int
    sample: bool
    draft: tuple[int, ...] = ()


class Scheduler:
    """Waiting queue and running set over a `KVAdapter`. `add` is thread-safe; everything else belongs
    to the engine's step."""

    def __init__(
        self, kv: KVAdapter, *, max_running: int, token_budget: int, preempt: bool, fair: bool = True
    ) -> None:
        if max_running < 1 or token_budget < 1:
            raise ValueError(f"max_running and token_budget must be >= 1, got {max_running}, {token_budget}")
        self.kv = kv
        self.max_running = max_running
        self.token_budget = token_budget
        self.preempt = preempt
        self.fair = fair
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._incoming: deque[Request] = deque()
        self._lock = threading.Lock()
        self.preemptions = 0

    def add(self, req: Request) -> None:
        """Queue a request (any thread)."""
        with self._lock:
            self._incoming.append(req)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._incoming)

    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._incoming)

    def pending(self) -> list[Request]:
        """Every request queued, waiting or running, in that order (the queues are left as they are)."""
        with self._lock:
            incoming = list(self._incoming)
        return [*incoming, *self.waiting, *self.running]

    def forget_incoming(self, req: Request) -> None:
        """Take a request that was queued but never scheduled back out (its owner failed it)."""
        with self._lock:
            if req in self._incoming:
                self._incoming.remove(req)

    def remove(self, req: Request) -> None:
        """Take a finished or failed request out of the queues (its KV is the caller's to handle)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def schedule(self) -> tuple[list[Chunk], list[Request]]:
        """The next step's chunks, and the requests found cancelled (taken out of the queues; their KV is
        still attached for the caller to release)."""
        with self._lock:
            self.waiting.extend(self._incoming)
            self._incoming.clear()
        cancelled = [r for r in (*self.running, *self.waiting) if r.cancelled]
        for r in cancelled:
            self.remove(r)
        budget = self.token_budget
        preempted = self.preemptions
        chunks: list[Chunk] = []
        # running requests: decodes first, then prefill chunks
        decodes, prefills = [], []
        for req in self.running:
            (decodes if req.pending == 1 else prefills).append(req)
        batch = len(self.running) + len(self.waiting)  # the requests this step may hold (for `_draft`)
        for req in decodes:
            if req.status is not Status.RUNNING or budget <= 0:  # preempted meanwhile, or no budget
                continue
            chunks, budget = self._feed(req, chunks, budget, budget, batch)
        # running prefills: within their share (all of the budget left, or half of it while requests wait
        # to be admitted), the oldest first (half of the share when others prefill beside it), then the
        # shortest remaining first
        fair = self.fair and bool(prefills)
        share = budget
        if fair and self.waiting and len(self.running) < self.max_running:
            share = budget - budget // 2
        order = self._prefill_order(prefills) if fair else prefills
        for i, req in enumerate(order):
            if req.status is not Status.RUNNING or budget <= 0 or share <= 0:
                continue
            cap = share // 2 if fair and i == 0 and len(order) > 1 else share
            before = budget
            chunks, budget = self._feed(req, chunks, budget, max(cap, 1), batch)
            share -= before - budget
        # waiting requests, first come first served (none in a step that had to preempt); a deferred one
        # keeps its place
        i = 0
        while (
            self.preemptions == preempted
            and i < len(self.waiting)
            and budget > 0
            and len(self.running) < self.max_running
        ):
            req = self.waiting[i]
            if self.kv.defer(req):
                i += 1
                continue
            if not self.kv.admit(req):
                break
            n = self._chunk(req, budget)
            if not self.kv.reserve(req, req.computed + n):
                self.kv.release(req)
                break
            del self.waiting[i]
            req.status = Status.RUNNING
            if req.admissions == 0:
                req.cached = req.computed  # what the cache supplied of the prompt (the request's stats)
            req.admissions += 1
            self.running.append(req)
            chunks.append(Chunk(req, req.computed, n, req.computed + n == req.num_tokens))
            budget -= n
        if fair and budget > 0:  # what the admissions left goes back to the running prefills, in order
            chunks, budget = self._top_up(order, chunks, budget)
        return chunks, cancelled

    def _prefill_order(self, prefills: list[Request]) -> list[Request]:
        """Running prefills in the order they are fed: the oldest (by arrival, `Request.id`: a preempted
        request keeps its age) first, so that it always progresses, then the fewest prompt tokens left first
        (ties by arrival), so that a short prompt is not held behind a long one."""
        oldest = min(prefills, key=lambda r: r.id)
        rest = sorted((r for r in prefills if r is not oldest), key=lambda r: (r.pending, r.id))
        return [oldest, *rest]

    def _feed(
        self, req: Request, chunks: list[Chunk], budget: int, cap: int, batch: int
    ) -> tuple[list[Chunk], int]:
        """Schedule `req`'s next chunk (at most `cap` tokens of the `budget` left), making room by preempting
        where the KV runs short; returns the chunks and the budget left."""
        n = self._chunk(req, min(budget, cap))
        if req.kv_limit is not None and req.computed + self._chunk(req, budget) > req.kv_limit:
            self._recompute(req)
            return chunks, budget
        draft = self._draft(req, budget, batch) if n == 1 == req.pending else ()
        while n and not self.kv.reserve(req, req.computed + n + len(draft)):
            if draft:  # no room for the drafts: a plain decode step
                draft = ()
                continue
            victim = self._victim()
            if victim is None:
                n = 0
                break
            budget += sum(c.n for c in chunks if c.req is victim)
            chunks = [c for c in chunks if c.req is not victim]
            self._preempt(victim)
            if victim is req:
                n = 0
        if n:
            chunks.append(Chunk(req, req.computed, n, req.computed + n == req.num_tokens, draft))
            budget -= n + len(draft)
        return chunks, budget

    def _top_up(self, order: list[Request], chunks: list[Chunk], budget: int) -> tuple[list[Chunk], int]:
        """Lengthen the running prefills' chunks of this step with the budget left (in `order`, within each
        request's chunk size, its KV limit and the pages the KV can still give; nobody is preempted for it)."""
        at = {id(c.req): i for i, c in enumerate(chunks)}
        for req in order:
            i = at.get(id(req))
            if budget <= 0:
                break
            if i is None or req.status is not Status.RUNNING:
                continue
            c = chunks[i]
            n = self._chunk(req, c.n + budget)
            if req.kv_limit is not None:
                n = min(n, req.kv_limit - c.start)
            if n > c.n and self.kv.reserve(req, c.start + n):
                chunks[i] = c._replace(n=n, sample=c.start + n == req.num_tokens)
                budget -= n - c.n
        return chunks, budget

    @staticmethod
    def _draft(req: Request, budget: int, batch: int) -> tuple[int, ...]:
        """Draft tokens for a decoding request that speculates (prompt lookup over its tokens) in a step of
        `batch` requests (`DraftControl.active`): no more than the budget, the tokens it may still generate
        and the context allow."""
        if req.drafts is None or not req.drafts.active(batch):
            return ()
        room = min(
            budget - 1, req.max_new_tokens - len(req.output) - 1, req.context_length - req.num_tokens - 1
        )
        if req.kv_limit is not None:  # the verify step ends where its KV stays valid
            room = min(room, req.kv_limit - req.computed - 1)
        k = min(req.drafts.budget(len(req.output)), room)
        return tuple(req.drafts.propose(req.prompt, req.output, k)) if k > 0 else ()

    def _chunk(self, req: Request, budget: int) -> int:
        n = min(req.pending, budget)
        if req.chunk_size:
            n = min(n, req.chunk_size)
        return n

    def _victim(self) -> Request | None:
        """The running request to preempt so that others can go on: the most recently admitted one."""
        if not self.preempt or not self.running:
            return None
        return self.running[-1]

    def _recompute(self, req: Request) -> None:
        """`req`'s next feed would pass the length its KV is valid for (`Request.kv_limit`): release its KV and
        put it at the head of the queue, to be admitted again (this step where there is room; not counted as a
        preemption) and computed anew, its generated tokens kept."""
        self.kv.release(req)
        self.running.remove(req)
        req.status = Status.WAITING
        req.computed = 0
        self.waiting.appendleft(req)

    def _preempt(self, victim: Request) -> None:
        self.kv.release(victim)
        self.running.remove(victim)
        victim.status = Status.WAITING
        victim.computed = 0
        self.waiting.appendleft(victim)
        self.preemptions += 1
