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


def test_capacity_buckets():
    from onnxgen.kv.buffers import capacity_bucket

    table = [
        ((1, 256), 256),
        ((256, 256), 256),
        ((257, 256), 512),
        ((0, 1), 1),
        ((1, 1), 1),
        ((2, 1), 2),
        ((3, 1), 4),
        ((1025, 256, 2000), 2000),
        ((2000, 256, 2000), 2000),
        ((2001, 256, 2000), 2048),
        ((1000, 256, 1024), 1024),
        ((1024, 256, 1024), 1024),
        ((100, 256, 2000), 256),
    ]
    # NOTE: 2001 over a limit of 2000 is 2048, the next power of two (the docstring says 4096)
    for args, want in table:
        assert capacity_bucket(*args) == want, (args, want)


def test_kv_buffers_keep_the_prefix_rewind_within_bounds_and_reset_or_free():
    torch = pytest.importorskip("torch")
    from onnxgen.errors import InvalidRequest
    from onnxgen.kv.buffers import KVBuffers

    with pytest.raises(InvalidRequest, match="kv_floor"):
        KVBuffers(1, 1, 2, torch.float32, "cpu", floor=0)
    assert KVBuffers(1, 1, 2, torch.float32, "cpu", floor=1).floor == 1
    default = KVBuffers(1, 1, 2, torch.float32, "cpu")
    default.reserve(1)
    assert default.capacity == 256  # the default floor
    kv = KVBuffers(2, 1, 3, torch.float32, "cpu", floor=2)
    kv.reserve(2)
    k = torch.arange(6, dtype=torch.float32).view(1, 1, 2, 3)  # 2 positions of head_dim 3
    for layer in range(2):
        kv.write(layer, 0, k + layer, -(k + layer))
    kv.set_length(2)
    gen = kv.generation
    assert kv.reserve(3) and kv.capacity == 4 and kv.generation == gen + 1
    keys, values = kv.view(1, 2)
    assert torch.equal(keys, k + 1) and torch.equal(values, -(k + 1))  # the valid prefix survived growth
    kv.rewind_to(2)
    kv.rewind_to(1)
    assert kv.length == 1
    kv.rewind_to(0)
    assert kv.length == 0
    kv.set_length(1)
    for bad in (2, -1):
        with pytest.raises(ValueError, match="rewind_to"):
            kv.rewind_to(bad)
    kv.reset()
    assert kv.length == 0 and kv.capacity == 4 and kv.generation == gen + 1  # emptied, buffers kept
    kv.reset(free=True)
    assert kv.capacity == 0 and kv.nbytes() == 0 and kv.generation == gen + 2


def test_a_failed_growth_leaves_an_empty_cache_not_a_half_grown_one():
    torch = pytest.importorskip("torch")
    from onnxgen.kv.buffers import KVBuffers

    calls = {"n": 0}

    def alloc(shape):
        calls["n"] += 1
        if calls["n"] > 4:  # the first growth (2 layers x K, V) works, the next runs out of memory
            raise MemoryError("out of memory")
        return torch.zeros(shape)

    kv = KVBuffers(2, 1, 2, torch.float32, "cpu", floor=2, alloc=alloc)
    kv.reserve(2)
    kv.set_length(2)
    with pytest.raises(MemoryError):
        kv.reserve(3)
    assert kv.length == 0 and kv.capacity == 0 and kv.nbytes() == 0


def test_page_storage_sizes_writes_gathers_and_copies_prefixes():
    torch = pytest.importorskip("torch")
    from onnxgen.kv.storage import PageStorage, page_bytes

    assert page_bytes(2, 4, 3, 5, 2) == 2 * 2 * 4 * 3 * 5 * 2
    st = PageStorage(2, 3, 4, 1, 2, torch.float32, "cpu")
    assert st.dtype == torch.float32 and st.device == torch.device("cpu")
    assert st.nbytes() == 3 * page_bytes(2, 4, 1, 2, 4) and st.keys(1).shape == (3, 4, 1, 2)
    st.data.zero_()
    rows = torch.arange(6, dtype=torch.float32).view(3, 1, 2)
    st.write(1, torch.tensor([4, 5, 6]), rows, -rows)  # page 1, offsets 0..2
    k, v = st.gather(1, torch.tensor([1]), 3)
    assert torch.equal(k, rows.transpose(0, 1)) and torch.equal(v, -rows.transpose(0, 1))
    st.copy_prefix(1, 2, 2)  # the first two positions only
    assert torch.equal(st.keys(1)[2, :2], rows[:2]) and torch.equal(st.keys(1)[2, 2:], torch.zeros(2, 1, 2))
    assert (
        torch.equal(st.values(1)[2, :2], -rows[:2]) and st.keys(0).abs().sum() == 0
    )  # other layer untouched
