"""Paged KV bookkeeping with exact page ids: the allocator, the prefix index and the manager (no torch).

Page size 4 throughout, so a 10-token sequence is pages [a, b, c] with c holding positions 8-9.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onnxgen.errors import OutOfPages
from onnxgen.kv.manager import InFlight, KVManager, PageTable
from onnxgen.kv.pages import PageAllocator
from onnxgen.kv.prefix import PrefixIndex

P = 4
D1, D2 = b"digest-one......", b"digest-two......"


class FakeStorage:
    """Records copy-on-write copies and keeps a per-slot token map, so tests can check what a page holds."""

    def __init__(self) -> None:
        self.copies: list[tuple[int, int, int]] = []
        self.slot: dict[int, int] = {}

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self.copies.append((src, dst, n))
        for i in range(n):
            self.slot[dst * P + i] = self.slot[src * P + i]

    def write(self, table: PageTable, start: int, tokens: list[int]) -> None:
        for s, t in zip(table.slots(start, len(tokens), P), tokens, strict=True):
            self.slot[s] = t

    def read(self, table: PageTable, n: int) -> list[int]:
        return [self.slot[s] for s in table.slots(0, n, P)]


def make(num_pages: int = 16) -> tuple[PageAllocator, PrefixIndex, KVManager, FakeStorage]:
    alloc = PageAllocator(num_pages)
    index = PrefixIndex(alloc, P)
    store = FakeStorage()
    return alloc, index, KVManager(alloc, index, store), store


def check(alloc: PageAllocator, index: PrefixIndex) -> None:
    alloc.check_integrity()
    index.check_integrity()


def run_request(
    kv: KVManager, store: FakeStorage, digest: bytes | None, tokens: list[int]
) -> tuple[PageTable, int]:
    """Open, compute (write every uncached position), and leave the table open."""
    table, cached = kv.open(digest, tokens)
    assert kv.grow(table, len(tokens))
    store.write(table, cached, tokens[cached:])
    return table, cached


# --- allocator ------------------------------------------------------------------------------------------


def test_allocator_hands_out_lowest_ids_and_counts_holders() -> None:
    a = PageAllocator(6)
    assert a.alloc(3) == [0, 1, 2]
    a.incref([1])
    assert a.decref([0, 1]) == [0]
    assert (a.refs(0), a.refs(1), a.refs(2)) == (0, 1, 1)
    assert a.alloc(2) == [0, 3]
    assert a.num_free == 2 and a.num_used == 4
    with pytest.raises(OutOfPages):
        a.alloc(3)
    assert a.num_free == 2, "a failed allocation changes nothing"
    a.check_integrity()
    with pytest.raises(AssertionError):
        a.decref([5])


# --- index ----------------------------------------------------------------------------------------------


def test_match_full_pages_then_partial_and_the_cap() -> None:
    alloc, index, _, _ = make()
    pages = alloc.alloc(3)  # [0, 1, 2] hold tokens 0..9
    node = index.insert(D1, list(range(10)), pages)
    assert [alloc.refs(p) for p in pages] == [2, 2, 2], "the index holds one reference per page"
    alloc.decref(pages)  # the request is done
    assert node.page == 2 and node.tokens == (8, 9)
    m = index.match(D1, list(range(12)))
    assert (m.pages, m.partial_page, m.partial_len, m.length) == ((0, 1), 2, 2, 10)
    m = index.match(D1, list(range(10)), limit=9)  # capped at len - 1
    assert (m.pages, m.partial_page, m.partial_len) == ((0, 1), 2, 1)
    m = index.match(D1, [0, 1, 2, 3, 4, 5, 99, 7])  # diverges inside the second page
    assert (m.pages, m.partial_page, m.partial_len) == ((0,), 1, 2)
    assert index.match(D2, list(range(12))).length == 0, "another identity shares nothing"
    assert index.match(None, list(range(12))).length == 0, "an undigestable identity shares nothing"
    check(alloc, index)


def test_insert_keeps_indexed_pages_and_skips_duplicates() -> None:
    alloc, index, _, _ = make()
    first = alloc.alloc(2)
    index.insert(D1, list(range(8)), first)
    alloc.decref(first)
    dup = alloc.alloc(3)  # another request computed the same 8 tokens again, plus 2 more
    end = index.insert(D1, list(range(10)), dup)
    assert [alloc.refs(p) for p in dup] == [1, 1, 2], "only the new last page is taken"
    assert alloc.decref(dup) == dup[:2], "the duplicates are freed when the request lets go"
    assert index.pages() == {*first, dup[2]} and end.page == dup[2]
    check(alloc, index)


def test_a_partial_page_is_not_indexed_when_an_indexed_page_starts_with_it() -> None:
    alloc, index, _, _ = make()
    full = alloc.alloc(2)
    index.insert(D1, list(range(8)), full)
    alloc.decref(full)
    mine = alloc.alloc(2)
    end = index.insert(D1, list(range(6)), mine)  # tokens 4, 5 are the start of page full[1]
    assert end.page == full[1]
    assert alloc.decref(mine) == mine
    assert index.num_nodes == 2
    check(alloc, index)


def test_a_full_page_supersedes_the_partial_leaf_it_extends() -> None:
    """A session's next turn copies its partial last page and fills it: once that full page is indexed the
    old partial leaf (the same positions, fewer of them) is dropped, unless something still holds it; a pin
    that held it drops it as it goes."""
    alloc, index, kv, store = make()
    t1, _ = run_request(kv, store, D1, list(range(10)))  # pages 0, 1 and a partial page 2 (tokens 8, 9)
    end1 = kv.commit(t1, list(range(10)))
    index.pin(end1)
    t2, cached = run_request(kv, store, D1, list(range(14)))  # copies page 2's two positions, fills to 13
    assert cached == 10
    kv.commit(t2, list(range(14)))
    assert end1.page in index.pages(), "a pinned partial leaf stays"
    index.unpin(end1)
    assert end1.page not in index.pages() and alloc.refs(end1.page) == 0, "unpinned: superseded, dropped"
    check(alloc, index)
    t3, _ = run_request(kv, store, D1, list(range(9)))  # a partial leaf (8) under the full page (8..11)
    end3 = kv.commit(t3, list(range(9)))
    assert end3.tokens == (8, 9, 10, 11), "an indexed full page that starts with the tokens is the end"
    t4, _ = run_request(
        kv, store, D1, list(range(6))
    )  # a partial leaf (4, 5) that no full page supersedes...
    end4 = kv.commit(t4, list(range(6)))
    assert end4.tokens == (4, 5, 6, 7)  # ...is none: page 1 (4..7) already starts with it
    check(alloc, index)


def test_evict_lru_leaves_that_only_the_index_holds() -> None:
    alloc, index, _, _ = make(8)
    a = alloc.alloc(2)
    index.insert(D1, list(range(8)), a)  # path A: a0 - a1
    alloc.decref(a)
    b = alloc.alloc(1)
    index.insert(D1, [*range(4), 50, 51, 52, 53], [a[0], b[0]])  # path B shares a0: a0 - b0
    alloc.decref(b)
    index.match(D1, list(range(8)))  # A is now the more recently used path
    assert index.evict(1) == 1 and index.pages() == {a[0], a[1]}, "B's leaf goes first (LRU)"
    held = alloc.alloc(0)
    alloc.incref([a[1]])  # a running request holds a1: not freeable
    assert index.evict(5) == 0
    alloc.decref([a[1]])
    assert index.evict(5) == 2 and index.pages() == set() and alloc.num_free == 8
    assert held == []
    check(alloc, index)


def test_a_pin_protects_the_whole_path() -> None:
    alloc, index, _, _ = make(8)
    pages = alloc.alloc(3)
    end = index.insert(D1, list(range(12)), pages)
    alloc.decref(pages)
    index.pin(end)
    assert index.evict(10) == 0
    index.unpin(end)
    assert index.evict(10) == 3
    with pytest.raises(AssertionError):
        index.unpin(end)
    check(alloc, index)


# --- manager --------------------------------------------------------------------------------------------


def test_open_shares_full_pages_and_copies_a_partly_matched_one() -> None:
    alloc, index, kv, store = make()
    t1, cached = run_request(kv, store, D1, list(range(10)))
    assert cached == 0 and t1.pages == [0, 1, 2]
    end = kv.commit(t1, list(range(10)))
    assert end is not None and t1.pages == [] and alloc.num_used == 3
    prompt = [*range(10), 77, 78, 79]
    t2, cached = kv.open(D1, prompt)
    assert cached == 10 and t2.pages == [0, 1, 3], "pages 0-1 shared; page 2's two positions copied to 3"
    assert store.copies == [(2, 3, 2)]
    assert kv.grow(t2, len(prompt))
    assert t2.pages == [0, 1, 3, 4]
    store.write(t2, cached, prompt[cached:])
    assert store.read(t2, len(prompt)) == prompt
    assert [alloc.refs(p) for p in (0, 1, 2)] == [2, 2, 1], "shared pages are never written: page 2 kept"
    kv.commit(t2, prompt)
    assert index.match(D1, [*prompt, 5]).length == 13
    check(alloc, index)


def test_open_shares_a_running_requests_computed_full_pages_when_they_beat_the_index() -> None:
    """`inflight`: a running request's full pages below its computed count, for the tokens both hold, capped
    at len - 1; the index's match when longer; nothing from a request whose tokens differ."""
    alloc, index, kv, store = make()
    leader_tokens = list(range(11))
    leader, _ = run_request(kv, store, D1, leader_tokens)  # pages [0, 1, 2]; running, nothing indexed
    running = [InFlight(leader_tokens, 11, leader.pages)]
    t, cached = kv.open(D1, [*range(10), 50, 51], running)
    assert cached == 8 and t.pages == [0, 1], "two full pages shared; page 2 is the leader's to write"
    assert [alloc.refs(p) for p in (0, 1, 2)] == [2, 2, 1] and kv.counters.inflight_hits == 1
    assert kv.grow(t, 12) and t.pages == [0, 1, 3]
    store.write(t, cached, [8, 9, 50, 51])
    assert store.read(t, 12) == [*range(10), 50, 51] and store.read(leader, 11) == leader_tokens
    t2, cached2 = kv.open(D1, list(range(8)), running)
    assert cached2 == 4 and t2.pages == [0], "capped at len - 1: one token is always computed"
    t3, cached3 = kv.open(D1, [0, 1, 2, 3, 99, 5, 6, 7, 8], [InFlight(leader_tokens, 5, leader.pages)])
    assert cached3 == 4 and t3.pages == [0], "only pages below the computed count whose tokens agree"
    t4, cached4 = kv.open(D1, [7, *range(1, 11)], running)
    assert cached4 == 0 and t4.pages == []
    kv.commit(leader, leader_tokens)
    t5, cached5 = kv.open(D1, [*range(11), 60], running)
    assert cached5 == 11 and kv.counters.inflight_hits == 3, "the index's longer match (with the copy) wins"
    for table in (t, t2, t3, t4, t5):
        kv.release(table)
    check(alloc, index)


def test_release_on_failure_leaves_nothing_visible() -> None:
    alloc, index, kv, store = make()
    t, _ = run_request(kv, store, D1, list(range(9)))
    kv.release(t)  # the request failed
    assert index.match(D1, list(range(9))).length == 0 and alloc.num_used == 0
    check(alloc, index)


def test_grow_evicts_and_otherwise_fails_without_change() -> None:
    alloc, index, kv, store = make(4)
    t, _ = run_request(kv, store, D1, list(range(12)))  # 3 pages
    kv.commit(t, list(range(12)))
    t2, cached = kv.open(D2, list(range(8)))
    assert cached == 0
    assert kv.grow(t2, 8) and t2.pages == [2, 3] and index.num_nodes == 2, (
        "one page was free, one LRU leaf evicted"
    )
    before = list(t2.pages)
    assert not kv.grow(t2, 20) and t2.pages == before
    kv.release(t2)
    check(alloc, index)


def test_eight_sessions_under_one_system_prompt_hold_one_copy() -> None:
    system = list(range(1000, 1500))  # 500 tokens = 125 pages
    alloc, index, kv, store = make(400)
    first, _ = run_request(kv, store, D1, [*system, 1])
    kv.commit(first, [*system, 1])
    pins = []
    for i in range(8):
        turn = [*system, 2000 + i, 2001 + i, 2002 + i]
        t, cached = run_request(kv, store, D1, turn)
        assert cached == 500
        pins.append(kv.commit(t, turn))
    # 125 system pages + page 125 of the first request + one own last page per session
    assert alloc.num_used == 125 + 1 + 8
    assert len(index.pages()) == alloc.num_used
    other, cached = kv.open(D2, [*system, 1])  # another salt: nothing shared
    assert cached == 0
    kv.release(other)
    check(alloc, index)


def test_undigestable_requests_share_and_keep_nothing() -> None:
    alloc, index, kv, store = make()
    t, _ = run_request(kv, store, None, list(range(9)))
    assert kv.commit(t, list(range(9))) is None
    assert index.num_nodes == 0 and alloc.num_used == 0
    check(alloc, index)


# --- property: the index answers like a plain list of committed sequences --------------------------------


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([D1, D2]), st.lists(st.integers(0, 3), min_size=1, max_size=14), st.booleans()
        ),
        min_size=1,
        max_size=25,
    )
)
def test_match_is_the_longest_committed_prefix_and_pages_hold_their_tokens(ops) -> None:
    alloc, index, kv, store = make(128)
    committed: list[tuple[bytes, list[int]]] = []
    for digest, tokens, ok in ops:
        table, cached = kv.open(digest, tokens)
        best = max((_lcp(t, tokens) for d, t in committed if d == digest), default=0)
        expect = min(best, len(tokens) - 1)
        assert cached == expect or (cached < expect and cached % P == 0), (cached, expect)
        assert kv.grow(table, len(tokens))
        assert store.read(table, cached) == tokens[:cached], "shared and copied positions hold the prefix"
        store.write(table, cached, tokens[cached:])
        if ok:
            kv.commit(table, tokens)
            committed.append((digest, tokens))
        else:
            kv.release(table)
        check(alloc, index)
    assert alloc.num_used == len(index.pages())


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# --- property: a lookup or an insertion that starts at an anchor answers as one from the root ------------


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.lists(st.integers(0, 3), min_size=0, max_size=9), st.booleans()),
        min_size=1,
        max_size=20,
    )
)
def test_anchored_turns_index_exactly_what_walks_from_the_root_index(ops) -> None:
    """Conversations (three of them, by `who`) grow turn by turn; the anchored twin opens and commits each
    turn from its conversation's last anchor (a session's), the plain twin from the root: every table,
    cached count, reference count and indexed page is the same, and the anchor spells the committed tokens."""
    twins = [make(200) for _ in range(2)]
    contexts: dict[int, list[int]] = {}
    anchors: dict[int, object] = {}
    for who, new, pinned in ops:
        tokens = contexts.get(who, []) + [who, *new]
        seen = []
        for anchored, (alloc, index, kv, store) in enumerate(twins):
            start = anchors.get(who) if anchored else None
            table, cached = kv.open(D1, tokens, start=start)
            assert kv.grow(table, len(tokens))
            store.write(table, cached, tokens[cached:])
            seen.append((list(table.pages), cached))
            end = kv.commit(table, tokens)
            a = table.anchor
            assert (
                a is not None
                and store.read(PageTable(D1, list(a.pages)), len(a.pages) * P) == tokens[: len(a.pages) * P]
            )
            assert len(a.pages) == len(tokens) // P, "the anchor is the last full page"
            if pinned:  # a session that lets go at once: a superseded partial leaf goes
                index.pin(end)
                index.unpin(end)
            if anchored:
                anchors[who] = a
            check(alloc, index)
        assert seen[0] == seen[1], "the same pages and cached positions"
        contexts[who] = tokens
    (a0, i0, _, _), (a1, i1, _, _) = twins
    assert i0.pages() == i1.pages() and [a0.refs(p) for p in range(200)] == [a1.refs(p) for p in range(200)]


def test_bulk_reference_counts_agree_with_single_steps() -> None:
    """Tables of more than 32 pages are counted in one vectorised pass: the same counts, frees and errors."""
    alloc = PageAllocator(100)
    pages = alloc.alloc(40)
    alloc.incref(pages)
    assert alloc.num_shared == 40 and all(alloc.refs(p) == 2 for p in pages)
    assert alloc.decref(pages) == [] and alloc.num_shared == 0
    assert alloc.decref(pages) == pages and alloc.num_free == 100
    with pytest.raises(AssertionError, match="free page"):
        alloc.decref(pages)
    with pytest.raises(AssertionError, match="free page"):
        alloc.incref(pages)
    alloc.check_integrity()  # the failed calls changed nothing
