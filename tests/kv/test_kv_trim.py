"""Pages given back as they fall out of every layer's sliding window (`KVManager.trim`), with exact page ids.

Page size 4. A trimmed table has holes (`HOLE`); what is still there (its present prefix) is all that is ever
indexed or shared: never KV that is gone (docs/reuse.md).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from onnxgen.kv.manager import HOLE, InFlight, KVManager, PageTable
from onnxgen.kv.pages import PageAllocator
from onnxgen.kv.prefix import PrefixIndex

P = 4
D = b"digest-one......"


class NoCopies:
    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Copy on write of a partly matched page: nothing to store here."""


def make(num_pages: int = 32) -> tuple[PageAllocator, PrefixIndex, KVManager]:
    alloc = PageAllocator(num_pages)
    index = PrefixIndex(alloc, P)
    return alloc, index, KVManager(alloc, index, NoCopies())


def opened(kv: KVManager, tokens: list[int], total: int) -> PageTable:
    table, _ = kv.open(D, tokens)
    assert kv.grow(table, total)
    return table


def test_trim_gives_back_whole_pages_below_the_position_once() -> None:
    alloc, _index, kv = make()
    table = opened(kv, list(range(30)), 30)  # pages 0..7
    assert table.pages == list(range(8)) and alloc.num_used == 8
    assert kv.trim(table, 7) == 1  # page 0 holds 0-3 (wholly below 7); page 1 holds 4-7 (position 7 is not)
    assert table.pages[:2] == [HOLE, 1] and table.first_hole == 0 and table.present() == 0
    assert kv.trim(table, 7) == 0 and kv.trim(table, 3) == 0  # looked at once; never moves back
    assert kv.trim(table, 16) == 3
    assert table.pages == [HOLE] * 4 + [4, 5, 6, 7] and alloc.num_used == 4
    assert kv.trim(table, 1000) == 4  # capped at the table's length
    kv.release(table)
    assert alloc.num_used == 0
    alloc.check_integrity()


def test_pages_the_index_or_another_request_holds_stay_present() -> None:
    """A prefix shared from the index (or by a running request) is not trimmed: it stays in the table and in
    the index; the request's own pages after it go."""
    alloc, index, kv = make()
    base = list(range(100, 108))  # two full pages
    t0 = opened(kv, base + [1], 9)
    assert kv.commit(t0, base + [1]) is not None  # indexed: pages 0, 1 (and the partial page 2)
    table = opened(kv, base + list(range(20)), 28)
    shared = table.pages[:2]
    assert [alloc.refs(p) for p in shared] == [2, 2]
    peer = opened(kv, list(range(50, 70)), 20)  # a running request's page shared by another one
    kv.allocator.incref([peer.pages[0]])
    assert kv.trim(table, 20) == 3 and kv.trim(peer, 8) == 1
    assert table.pages[:2] == shared and table.pages[2:5] == [HOLE] * 3 and table.present() == 2
    assert peer.pages[:2] == [peer.pages[0], HOLE] and peer.present() == 1
    kv.allocator.decref([peer.pages[0]])
    kv.release(peer)
    # committed: only the present prefix (the two shared pages) is indexed; nothing of the holes
    n_before = index.num_nodes
    node = kv.commit(table, base + list(range(20)))
    assert node is not None and index.num_nodes == n_before
    alloc.check_integrity()
    index.check_integrity()
    m = index.match(D, base + list(range(20)), 27)
    assert m.length == 8 and list(m.pages) == shared


def test_a_fully_trimmed_request_indexes_nothing_and_frees_everything() -> None:
    alloc, index, kv = make()
    tokens = list(range(40))
    table = opened(kv, tokens, 40)
    kv.trim(table, 33)
    assert table.present() == 0
    assert kv.commit(table, tokens) is None and index.num_nodes == 0 and alloc.num_used == 0
    alloc.check_integrity()


def test_running_requests_share_only_present_pages() -> None:
    """What `PagedKV.admit` passes for a trimmed peer (its present prefix) gives the newcomer nothing that is
    gone."""
    alloc, _index, kv = make()
    tokens = list(range(24))
    peer = opened(kv, tokens, 24)
    kv.trim(peer, 9)  # pages 0 and 1 given back
    table, cached = kv.open(D, tokens + [7], [InFlight(tokens, 24, peer.pages[: peer.present()])])
    assert cached == 0 and HOLE not in table.pages
    kv.release(table)
    kv.release(peer)
    alloc.check_integrity()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.booleans()), min_size=1, max_size=12))
def test_trimming_never_leaks_or_double_frees(ops: list[tuple[int, int, bool]]) -> None:
    """Requests grow, trim at random windows, commit or release: every page is free xor held, the index holds
    only pages that are there, and everything is free once the index is cleared."""
    alloc, index, kv = make(64)
    for n, window, ok in ops:
        tokens = [t % 7 for t in range(n)]
        table, cached = kv.open(D, tokens)
        if not kv.grow(table, n):
            kv.release(table)
            continue
        for pos in range(cached, n):
            kv.trim(table, pos - window + 1)
            assert all(p == HOLE or alloc.refs(p) > 0 for p in table.pages)
        if ok:
            kv.commit(table, tokens)
        else:
            kv.release(table)
        alloc.check_integrity()
        index.check_integrity()
    index.clear()
    assert alloc.num_used == 0
