"""Edges of the paged KV bookkeeping found untested by the mutation run (benchmarks/mutation.py,
docs/mutation.md): pool and page sizes at their lower bounds, a node's depth, matches of one token or with no
partial candidate, and the recency a partial match gives. Exact page ids, page size 4, no torch."""

from __future__ import annotations

import pytest

from onnxgen.errors import OutOfPages
from onnxgen.kv.pages import PageAllocator
from onnxgen.kv.prefix import PrefixIndex

P = 4
D = b"digest-one......"


def test_a_pool_of_one_page_and_pages_of_one_token_are_the_smallest():
    alloc = PageAllocator(1)
    assert alloc.alloc(1) == [0] and alloc.num_free == 0
    with pytest.raises(OutOfPages):
        alloc.alloc(1)
    with pytest.raises(ValueError, match="at least one page"):
        PageAllocator(0)
    index = PrefixIndex(PageAllocator(2), 1)
    assert index.page_size == 1
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        PrefixIndex(PageAllocator(2), 0)


def test_a_nodes_depth_counts_the_tokens_from_the_root():
    alloc = PageAllocator(4)
    index = PrefixIndex(alloc, P)
    pages = alloc.alloc(3)
    end = index.insert(D, list(range(10)), pages)  # two full pages and a partial one of 2 tokens
    assert end.depth_tokens() == 10
    assert end.parent.depth_tokens() == 8 and end.parent.parent.depth_tokens() == 4
    assert end.parent.parent.parent.depth_tokens() == 0  # the root


def test_one_token_matches_the_start_of_an_indexed_page():
    alloc = PageAllocator(4)
    index = PrefixIndex(alloc, P)
    index.insert(D, [7, 8, 9, 10], alloc.alloc(1))
    m = index.match(D, [7, 8, 9, 10, 11], limit=1)
    assert (m.pages, m.partial_len, m.length) == ((), 1, 1) and m.partial_page is not None
    assert index.match(D, [7], limit=0).length == 0


def test_a_match_without_a_partial_candidate_is_whole_pages_only():
    alloc = PageAllocator(4)
    index = PrefixIndex(alloc, P)
    pages = alloc.alloc(1)
    index.insert(D, [1, 2, 3, 4], pages)
    m = index.match(D, [1, 2, 3, 4, 5, 6])  # nothing indexed after the first page
    assert m.pages == (pages[0],) and m.partial_page is None and m.partial_len == 0 and m.length == 4
    assert index.match(D, [9, 9]).length == 0 and index.match(None, [1, 2, 3, 4]).length == 0


def test_a_partial_match_makes_the_matched_leaf_recently_used():
    alloc = PageAllocator(8)
    index = PrefixIndex(alloc, P)
    p0, pa = alloc.alloc(2)
    index.insert(D, [0, 1, 2, 3, 10, 11], [p0, pa])  # leaf A: (10, 11)
    (pb,) = alloc.alloc(1)
    index.insert(D, [0, 1, 2, 3, 20, 21], [p0, pb])  # leaf B: (20, 21), more recent than A
    alloc.decref([p0, pa, pb])  # only the index holds them now
    m = index.match(D, [0, 1, 2, 3, 10, 99])  # A's leaf matches one position
    assert m.partial_page == pa and m.partial_len == 1
    assert index.evict(1) == 1 and index.pages() == {p0, pa}  # B, now the least recently used, goes
    index.check_integrity()
    alloc.check_integrity()


def test_eviction_follows_recency_exactly_and_clear_keeps_pinned_paths():
    alloc = PageAllocator(32)
    index = PrefixIndex(alloc, P)
    (root_page,) = alloc.alloc(1)
    leaves = []
    for i in range(12):  # 12 sibling leaves under one shared page
        (p,) = alloc.alloc(1)
        index.insert(D, [0, 1, 2, 3, 100 + i, 0, 0, 0], [root_page, p])
        leaves.append(p)
    alloc.decref([root_page, *leaves])
    order = [5, 0, 11, 3, 8, 1, 10, 2, 7, 4, 9, 6]  # use them in this order: 6 is the most recent
    for i in order:
        index.match(D, [0, 1, 2, 3, 100 + i, 0, 0, 0])
    assert index.evict(0) == 0 and index.evict(-1) == 0 and len(index.pages()) == 13
    freed_order = []
    for _ in range(11):
        before = index.pages()
        assert index.evict(1) == 1
        (gone,) = before - index.pages()
        freed_order.append(leaves.index(gone))
    assert freed_order == order[:11]  # least recently used first, one at a time
    end = index.insert(D, [0, 1, 2, 3, 100 + 6, 0, 0, 0], [root_page, leaves[6]])  # present already
    index.pin(end)
    (other,) = alloc.alloc(1)
    index.insert(D, [50, 51, 52, 53], [other])
    alloc.decref([other])
    assert index.clear() == 1 and index.pages() == {root_page, leaves[6]}  # the pinned path stays
    index.unpin(end)
    assert index.clear() == 2 and index.pages() == set() and alloc.num_free == 32
    alloc.check_integrity()
    index.check_integrity()


def test_open_shares_all_but_the_last_token_of_a_fully_indexed_prompt():
    from onnxgen.kv.manager import KVManager

    class Copies:
        def __init__(self):
            self.done = []

        def copy_prefix(self, src, dst, n):
            self.done.append((src, dst, n))

    alloc = PageAllocator(8)
    index = PrefixIndex(alloc, P)
    store = Copies()
    kv = KVManager(alloc, index, store)
    tokens = list(range(10))
    pages = alloc.alloc(3)
    index.insert(D, tokens, pages)
    alloc.decref(pages)
    table, cached = kv.open(D, tokens)  # the whole prompt is indexed: one token is still computed
    assert cached == 9 and table.pages[:2] == pages[:2] and store.done == [(pages[2], table.pages[2], 1)]
    kv.release(table)
    table, cached = kv.open(D, tokens[:8])  # two whole pages indexed: the second is copied up to 3 positions
    assert cached == 7 and table.pages[0] == pages[0] and store.done[-1] == (pages[1], table.pages[1], 3)


def test_kv_buffers_grow_from_empty_and_only_when_needed():
    torch = pytest.importorskip("torch")
    from onnxgen.kv.buffers import KVBuffers

    kv = KVBuffers(2, 1, 4, torch.float32, "cpu", floor=1)
    assert (kv.capacity, kv.length, kv.nbytes()) == (0, 0, 0)
    gen = kv.generation
    assert kv.reserve(1) is True and kv.capacity == 1 and kv.generation == gen + 1  # a first 1-token cache
    assert kv.reserve(1) is False and kv.generation == gen + 1  # already room: nothing reallocated
    assert kv.nbytes() == 2 * 2 * 1 * 4 * 4  # layers x (K, V) x capacity x head_dim x 4 bytes
    assert kv.reserve(3) is True and kv.capacity == 4
