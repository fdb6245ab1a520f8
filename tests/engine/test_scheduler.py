"""The scheduler over a fake KV adapter that counts pages: budgets, order, chunking, preemption."""

from __future__ import annotations

import threading

import pytest

from onnxgen.engine.request import Request, Status
from onnxgen.engine.scheduler import Scheduler

P = 4


class PagesKV:
    """A KV adapter with `pages` pages of P positions; admission caches nothing."""

    def __init__(self, pages: int) -> None:
        self.free = pages
        self.released: list[int] = []

    def admit(self, req: Request) -> bool:
        req.kv = 0
        req.computed = 0
        return True

    def reserve(self, req: Request, total: int) -> bool:
        need = -(-total // P) - req.kv
        if need > self.free:
            return False
        self.free -= max(need, 0)
        req.kv += max(need, 0)
        return True

    def release(self, req: Request) -> None:
        self.free += req.kv
        req.kv = 0
        self.released.append(req.id)

    deferred: frozenset[int] = frozenset()  # ids of requests `defer` holds back

    def defer(self, req: Request) -> bool:
        return req.id in self.deferred


def request(n: int, chunk: int | None = None) -> Request:
    return Request(
        prompt=list(range(1, n + 1)),
        digest=b"d",
        sampler=None,
        detokenizer=None,
        max_new_tokens=8,
        context_length=1024,
        eos_ids=frozenset(),
        chunk_size=chunk,
    )


def feed(chunks, sample_token: int = 7) -> None:
    """What the engine does after running a step: advance `computed`, append a token where sampled."""
    for c in chunks:
        c.req.computed = c.start + c.n
        if c.sample:
            c.req.output.append(sample_token)


def plan(chunks) -> list[tuple[int, int, int, bool]]:
    return [(c.req.id, c.start, c.n, c.sample) for c in chunks]


def test_decodes_first_then_prefill_chunks_then_admissions_within_the_budget() -> None:
    s = Scheduler(PagesKV(100), max_running=8, token_budget=8, preempt=True)
    a, b, c = request(3), request(9), request(5)
    for r in (a, b, c):
        s.add(r)
    chunks, _ = s.schedule()
    assert plan(chunks) == [(a.id, 0, 3, True), (b.id, 0, 5, False)]
    feed(chunks)
    chunks, _ = s.schedule()  # a decodes (1), b continues (4 of 4 left), c gets the remaining 3
    assert plan(chunks) == [(a.id, 3, 1, True), (b.id, 5, 4, True), (c.id, 0, 3, False)]
    feed(chunks)
    chunks, _ = s.schedule()
    assert plan(chunks) == [(a.id, 4, 1, True), (b.id, 9, 1, True), (c.id, 3, 2, True)]


@pytest.mark.parametrize(
    ("n", "chunk", "sizes"), [(10, 4, [4, 4, 2]), (8, 4, [4, 4]), (8, 8, [8]), (5, None, [5])]
)
def test_chunk_size_caps_a_requests_prefill(n: int, chunk: int | None, sizes: list[int]) -> None:
    s = Scheduler(PagesKV(100), max_running=8, token_budget=100, preempt=True)
    r = request(n, chunk=chunk)
    s.add(r)
    got = []
    while not r.output:
        chunks, _ = s.schedule()
        got.append(chunks[0].n)
        feed(chunks)
    assert got == sizes, "no chunk is dropped, and the last one samples"


def test_running_set_is_bounded_and_waiting_is_fcfs() -> None:
    s = Scheduler(PagesKV(100), max_running=2, token_budget=100, preempt=True)
    reqs = [request(2) for _ in range(4)]
    for r in reqs:
        s.add(r)
    chunks, _ = s.schedule()
    assert [c.req for c in chunks] == reqs[:2] and s.num_waiting() == 2
    s.remove(reqs[0])
    chunks, _ = s.schedule()
    assert [c.req for c in chunks] == [reqs[1], reqs[2]]


def test_out_of_pages_preempts_the_newest_and_it_is_recomputed() -> None:
    kv = PagesKV(4)
    s = Scheduler(kv, max_running=4, token_budget=64, preempt=True)
    a, b = request(7), request(7)  # 2 pages each: the pool is full after both are admitted
    s.add(a)
    s.add(b)
    chunks, _ = s.schedule()
    assert [c.req for c in chunks] == [a, b] and kv.free == 0
    feed(chunks)  # both sampled a token: 8 tokens, 7 computed; the next decode needs position 7 (page 2)
    chunks, _ = s.schedule()
    feed(chunks)
    # a's decode fit in its second page; b's too. Now both need a third page: b (newest) is preempted.
    chunks, _ = s.schedule()
    assert plan(chunks) == [(a.id, 8, 1, True)]
    assert b.status is Status.WAITING and b.computed == 0 and kv.released == [b.id]
    assert s.preemptions == 1 and s.waiting[0] is b and len(b.output) == 2, "its generated tokens are kept"
    s.remove(a)
    kv.release(a)
    chunks, _ = s.schedule()  # b is admitted again and recomputes prompt + output in one chunk
    assert plan(chunks) == [(b.id, 0, 9, True)]


def test_a_waiting_request_that_does_not_fit_waits() -> None:
    kv = PagesKV(2)
    s = Scheduler(kv, max_running=4, token_budget=64, preempt=True)
    big, small = request(20), request(2)
    s.add(big)
    s.add(small)
    chunks, _ = s.schedule()
    assert chunks == [] and s.num_waiting() == 2 and kv.free == 2, "head of line waits; nothing leaks"


def test_cancelled_requests_are_taken_out() -> None:
    s = Scheduler(PagesKV(100), max_running=4, token_budget=64, preempt=True)
    a, b = request(3), request(3)
    a.cancel = threading.Event()
    s.add(a)
    s.add(b)
    chunks, _ = s.schedule()
    feed(chunks)
    a.cancel.set()
    chunks, cancelled = s.schedule()
    assert cancelled == [a] and plan(chunks) == [(b.id, 3, 1, True)] and a not in s.running


def test_a_deferred_request_keeps_its_place_while_later_ones_are_admitted() -> None:
    kv = PagesKV(100)
    s = Scheduler(kv, max_running=8, token_budget=64, preempt=True)
    a, b, c = request(5), request(6), request(7)
    for r in (a, b, c):
        s.add(r)
    kv.deferred = frozenset({b.id})
    chunks, _ = s.schedule()
    assert [c_.req.id for c_ in chunks] == [a.id, c.id] and list(s.waiting) == [b]
    feed(chunks)
    kv.deferred = frozenset()
    chunks, _ = s.schedule()
    assert [c_.req.id for c_ in chunks] == [a.id, c.id, b.id] and not s.waiting
    assert plan(chunks)[-1] == (b.id, 0, 6, True)


class LimitKV(PagesKV):
    """As LongRoPE's paged KV: a request admitted at most `limit` tokens long holds KV valid up to `limit`."""

    def __init__(self, pages: int, limit: int) -> None:
        super().__init__(pages)
        self.limit = limit

    def admit(self, req: Request) -> bool:
        req.kv_limit = self.limit if req.num_tokens <= self.limit else None
        return super().admit(req)


class Drafts:
    """A draft control that always proposes as many tokens as asked for."""

    def active(self, batch: int) -> bool:
        return True

    def budget(self, generated: int) -> int:
        return 8

    def propose(self, prompt: list[int], output: list[int], k: int) -> list[int]:
        return [5] * k


def test_a_request_is_recomputed_where_its_kv_stops_being_valid_and_no_draft_crosses_it() -> None:
    """`Request.kv_limit` (LongRoPE's switch at 10 here): drafts stop at it; the step that would feed past it
    releases the request's KV and admits it again in the same step, in one chunk of all its tokens (not a
    preemption), and then nothing limits it."""
    kv = LimitKV(100, limit=10)
    s = Scheduler(kv, max_running=4, token_budget=64, preempt=True)
    r, other = request(6), request(3)
    r.drafts = Drafts()
    s.add(r)
    s.add(other)
    chunks, _ = s.schedule()
    assert plan(chunks) == [(r.id, 0, 6, True), (other.id, 0, 3, True)] and r.kv_limit == 10
    feed(chunks)  # r: 7 tokens, 6 computed
    chunks, _ = s.schedule()
    assert chunks[0].req is r and chunks[0].draft == (5, 5, 5)  # feeds positions 6..9: the last valid one
    r.computed, r.output = 10, r.output + [5, 5, 5, 5]  # every draft accepted: 11 tokens, 10 computed
    feed(chunks[1:])
    chunks, _ = s.schedule()
    assert plan(chunks) == [(other.id, 4, 1, True), (r.id, 0, 11, True)]
    assert r.kv_limit is None and r.status is Status.RUNNING and kv.released == [r.id]
    assert s.preemptions == 0 and r.admissions == 2 and r.cached == 0


# --- fair prefill (`prefill_policy="fair"`) --------------------------------------------------------------


def first_token_steps(s: Scheduler, arrivals: dict[int, list[Request]], steps: int) -> dict[int, int]:
    """Run `s` for `steps` steps, adding `arrivals[k]` before step k; the step at which each request sampled
    its first token, counted from its arrival. Asserts every step uses the whole budget while prefills want it."""
    came: dict[int, int] = {}
    first: dict[int, int] = {}
    for k in range(steps):
        for r in arrivals.get(k, []):
            s.add(r)
            came[r.id] = k
        wanted = sum(min(r.pending, r.chunk_size or r.pending) for r in s.pending())
        chunks, _ = s.schedule()
        assert sum(c.n for c in chunks) == min(s.token_budget, wanted), "no budget is left unused"
        feed(chunks)
        for c in chunks:
            if c.sample and c.req.id not in first:
                first[c.req.id] = k - came[c.req.id] + 1
    return first


@pytest.mark.parametrize("fair", [True, False])
def test_a_short_prompt_is_not_held_behind_a_long_prefill(fair: bool) -> None:
    """A 400-token prompt prefills at 32 tokens a step; short prompts arriving one step later each get their
    first token within two steps (first come first served held them for the long prompt's 12 more steps),
    and the long prompt is not starved: it still ends its prefill within a few steps of its own 13."""
    s = Scheduler(PagesKV(1000), max_running=8, token_budget=32, preempt=True, fair=fair)
    long, shorts = request(400), [request(6) for _ in range(3)]
    first = first_token_steps(s, {0: [long], 1: shorts}, 24)
    waits = [first.get(r.id, 99) for r in shorts]
    if not fair:
        assert min(waits) > 10, "first come first served: the shorts wait for the whole long prefill"
        return
    assert max(waits) <= 2, waits
    assert first[long.id] <= 400 // 32 + 3, first[long.id]


@pytest.mark.parametrize("fair", [True, False])
def test_among_running_prefills_the_shortest_left_goes_first_and_the_oldest_always_progresses(fair) -> None:
    """A long prompt and a shorter one (chunked by 16) arriving together: the shorter one's prefill is not
    held for the long one's; the oldest still gets a share every step."""
    s = Scheduler(PagesKV(1000), max_running=8, token_budget=32, preempt=True, fair=fair)
    long, mid = request(300), request(40, chunk=16)
    first = first_token_steps(s, {0: [long, mid]}, 14)
    if not fair:
        assert first[mid.id] > 8, "first come first served: the long prefill takes every step's budget"
        return
    assert first[mid.id] <= 4, first[mid.id]
    assert first[long.id] <= 300 // 32 + 3


def test_fair_prefill_keeps_arrival_order_for_a_burst_of_equal_prompts() -> None:
    """Equal prompts arriving together are admitted first come first served, each with its whole prompt
    where the budget allows: the first get their tokens first (no processor sharing that would delay all)."""
    s = Scheduler(PagesKV(1000), max_running=16, token_budget=32, preempt=True)
    burst = [request(10) for _ in range(6)]
    first = first_token_steps(s, {0: burst}, 6)
    assert [first[r.id] for r in burst] == [1, 1, 1, 2, 2, 2]


def test_fair_prefill_gives_a_prompt_everything_while_its_followers_are_deferred() -> None:
    """Requests deferred behind a running prefill (they will share its pages) take nothing from it: it keeps the
    whole budget every step, as they need it done."""
    kv = PagesKV(1000)
    s = Scheduler(kv, max_running=16, token_budget=32, preempt=True)
    lead, followers = request(100), [request(110) for _ in range(4)]
    kv.deferred = frozenset(r.id for r in followers)
    s.add(lead)
    for r in followers:
        s.add(r)
    sizes = []
    for _ in range(4):
        chunks, _ = s.schedule()
        sizes.append([(c.req.id, c.n) for c in chunks])
        feed(chunks)
    assert sizes == [[(lead.id, 32)], [(lead.id, 32)], [(lead.id, 32)], [(lead.id, 4)]]
