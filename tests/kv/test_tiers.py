"""The host tier of the paged pool (`kv/tiers.py`) on a real CPU page storage: pages copied out and back bit
for bit under their path's key, least recently used first out, never more than its bound (hypothesis over
random save / backup / evict / restore orders, against a model of the LRU); and the manager's restores: a
request continuing an indexed prefix into evicted pages gets them back, and every shared position holds the
KV of exactly its tokens under its identity (no other conversation's, no other tenant's)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from onnxgen.kv.manager import KVManager  # noqa: E402
from onnxgen.kv.pages import PageAllocator  # noqa: E402
from onnxgen.kv.prefix import PrefixIndex  # noqa: E402
from onnxgen.kv.storage import PageStorage  # noqa: E402
from onnxgen.kv.tiers import HostPages, page_key  # noqa: E402

P, LAYERS, HEADS, DIM = 4, 2, 2, 3
D1, D2 = b"digest-one......", b"digest-two......"


def storage(pages: int) -> PageStorage:
    return PageStorage(LAYERS, pages, P, HEADS, DIM, torch.float32, "cpu")


def page_bytes() -> int:
    return LAYERS * 2 * P * HEADS * DIM * 4


def fill(s: PageStorage, page: int, value: float) -> None:
    """A page whose every element tells its value, its layer and K or V apart."""
    for layer in range(LAYERS):
        for kv in range(2):
            s.data[layer, kv, page] = value + 0.25 * layer + 0.125 * kv


def test_pages_round_trip_bit_for_bit_and_the_oldest_go_first():
    s = storage(6)
    tier = HostPages(s, 3 * page_bytes() + page_bytes() // 2)  # room for 3 pages, not 4
    assert tier.capacity == 3 and tier.arena_bytes == 0  # nothing allocated before a page arrives
    keys = [bytes([i]) * 16 for i in range(5)]
    for i in range(4):
        fill(s, i, 10.0 * i)
    want = s.data[:, :, :4].clone()
    tier.save(keys[:4], [0, 1, 2, 3])  # one more than fits: the first is not kept
    assert tier.keys() == keys[1:4] and tier.nbytes == 3 * page_bytes() <= tier.max_bytes
    assert tier.arena_bytes <= tier.max_bytes
    s.data.zero_()  # the pool reuses the pages
    assert tier.find(keys[1:3]) == 2  # found, and marked used: keys[3] is now the oldest
    assert tier.load(keys[1:3], [5, 4]) is None  # the CPU copies at once
    assert torch.equal(s.data[:, :, 5], want[:, :, 1]) and torch.equal(s.data[:, :, 4], want[:, :, 2])
    fill(s, 0, 99.0)
    tier.save([keys[4]], [0])
    assert tier.keys() == [keys[1], keys[2], keys[4]] and tier.counters.dropped == 2
    tier.save([keys[2]], [1])  # held already: no copy, only marked used
    assert tier.counters.saved == 4 and tier.keys() == [keys[1], keys[4], keys[2]]
    tier.clear()
    assert len(tier) == 0 and tier.arena_bytes == 0


def test_copies_span_slabs_and_chunks(monkeypatch):
    """Slots are carved from slabs and copied through staging chunks: runs that cross either still land on
    the right pages."""
    import onnxgen.kv.tiers as tiers

    monkeypatch.setattr(tiers, "SLAB_BYTES", 3 * page_bytes())
    monkeypatch.setattr(tiers, "CHUNK_BYTES", 2 * page_bytes())
    s = storage(16)
    tier = HostPages(s, 8 * page_bytes())
    for i in range(8):
        fill(s, i, float(i + 1))
    want = s.data[:, :, :8].clone()
    keys = [bytes([i]) * 16 for i in range(8)]
    tier.save(keys, list(range(8)))
    assert len(tier._slabs) == 3  # 3 + 3 + 2 slots
    dest = [15, 9, 8, 14, 10, 13, 12, 11]
    tier.load(keys, dest)
    for i, d in enumerate(dest):
        assert torch.equal(s.data[:, :, d], want[:, :, i]), i


OPS = st.lists(
    st.tuples(
        st.sampled_from(["save", "backup", "load", "forget"]),
        st.lists(st.integers(0, 7), min_size=1, max_size=5, unique=True),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=120, deadline=None)
@given(capacity=st.integers(1, 5), extra=st.integers(0, page_bytes() - 1), ops=OPS)
def test_the_tier_is_an_lru_that_never_exceeds_its_bound(capacity, extra, ops):
    """Random orders of saves (evictions), backups, restores and drops against a model: the same keys in the
    same least-recently-used order, never more bytes than the bound (nor arena), and every restored page
    holds exactly what was saved under its key."""
    s = storage(8 + 1)
    bound = capacity * page_bytes() + extra
    tier = HostPages(s, bound)
    model: OrderedDict[int, None] = OrderedDict()
    for op, ids in ops:
        keys = [bytes([i]) * 16 for i in ids]
        if op in ("save", "backup"):
            for page, i in enumerate(ids):
                fill(s, page, 100.0 * i)  # a key's KV is always the same
            getattr(tier, op)(keys, list(range(len(ids))))
            held = [i for i in ids if i in model]
            new = [i for i in ids if i not in model][-capacity:]
            for i in held:
                model.move_to_end(i)
            for i in new:
                if len(model) == capacity:
                    model.popitem(last=False)
                model[i] = None
        elif op == "load":
            n = tier.find(keys)
            k = 0
            while k < len(ids) and ids[k] in model:
                model.move_to_end(ids[k])
                k += 1
            assert n == k
            if n:
                tier.load(keys[:n], list(range(n)))
                for page, i in enumerate(ids[:n]):
                    fill(s, 8, 100.0 * i)
                    assert torch.equal(s.data[:, :, page], s.data[:, :, 8]), (op, ids)
        else:
            tier.forget(keys)
            for i in ids:
                model.pop(i, None)
        assert tier.keys() == [bytes([i]) * 16 for i in model]
        assert tier.nbytes <= bound and tier.arena_bytes <= bound


# --- the manager: evicted pages restored instead of recomputed ------------------------------------------


def kv_value(digest: bytes, tokens: list[int], p: int) -> float:
    """The stand-in KV of position `p`: a function of the identity and of every token up to `p`, as a real
    model's is (exact in float32)."""
    h = sum(digest) % (1 << 20)  # differs between the two test digests
    for t in tokens[: p + 1]:
        h = (h * 31 + t) % (1 << 20)
    return float(h)


def compute(s: PageStorage, table, digest: bytes, tokens: list[int], start: int) -> None:
    """Write the stand-in KV of positions [start, len(tokens)) at the table's slots."""
    n = len(tokens) - start
    if n <= 0:
        return
    slots = torch.tensor(table.slots(start, n, P), dtype=torch.int64)
    vals = torch.tensor([kv_value(digest, tokens, p) for p in range(start, len(tokens))])
    kv = vals.view(n, 1, 1).expand(n, HEADS, DIM).contiguous()
    for layer in range(LAYERS):
        s.write(layer, slots, kv, kv + 0.5)


def check_holds(s: PageStorage, table, digest: bytes, tokens: list[int], n: int) -> None:
    """Positions [0, n) of the table hold the KV of `tokens` under `digest`."""
    if n == 0:
        return
    pages = torch.tensor(table.pages[: -(-n // P)], dtype=torch.int64)
    want = torch.tensor([kv_value(digest, tokens, p) for p in range(n)])
    for layer in range(LAYERS):
        k, v = s.gather(layer, pages, n)
        assert torch.equal(k[0, :, 0], want) and torch.equal(v[1, :, 2], want + 0.5), (layer, n)


def manager(pages: int, host_pages: int) -> tuple[KVManager, PageStorage, HostPages]:
    s = storage(pages)
    tier = HostPages(s, host_pages * page_bytes())
    alloc = PageAllocator(pages)
    kv = KVManager(alloc, PrefixIndex(alloc, P), s, tier)
    return kv, s, tier


def turn(kv: KVManager, s: PageStorage, digest: bytes, tokens: list[int]) -> tuple[int, int]:
    """One request: restore what the tier holds, open, check what is shared, compute the rest, commit.
    Returns (cached positions, of them restored from the tier)."""
    before = kv.counters.restored_tokens
    landing = kv.plan_restore(digest, tokens)
    if landing is not None:
        assert landing.ready()
        kv.land(landing)
    table, cached = kv.open(digest, tokens)
    check_holds(s, table, digest, tokens, cached)
    if not kv.grow(table, len(tokens)):
        kv.release(table)
        return cached, kv.counters.restored_tokens - before
    compute(s, table, digest, tokens, cached)
    kv.commit(table, tokens)
    return cached, kv.counters.restored_tokens - before


def test_a_request_continuing_evicted_pages_restores_them():
    kv, s, tier = manager(pages=8, host_pages=16)
    a = list(range(1, 22))  # 5 full pages + 1 token
    turn(kv, s, D1, a)
    assert kv.index.evict(8, tier.save) == 6  # the pool needs its pages: the full ones go to the tier
    assert len(tier) == 5 and kv.index.num_nodes == 0
    key = D1
    for i in range(5):
        key = page_key(key, a[i * P : (i + 1) * P])
        assert key in tier  # the path's key: identity digest, then each page's tokens
    cached, restored = turn(kv, s, D1, [*a, 30, 31])
    assert restored == 20 and cached == 20  # the 5 full pages come back; the partial page is recomputed
    assert turn(kv, s, D2, [*a, 30, 31]) == (0, 0)  # another identity: the same tokens share nothing
    kv.allocator.check_integrity()
    kv.index.check_integrity()


@settings(max_examples=25, deadline=None)
@given(host_pages=st.integers(1, 12), pool=st.integers(6, 10), seed=st.integers(0, 1 << 16))
def test_random_orders_share_only_the_right_kv_and_stay_within_bounds(host_pages, pool, seed):
    """Four conversations (two share a prefix; one under another identity with the same tokens) growing in
    120 random turns, with random evictions and unrelated requests pressing on a small pool: every position a
    request shares (from the index, restored or not) holds its own tokens' KV under its own identity, the
    tier never exceeds its bound, and the index and allocator stay consistent."""
    import random

    rng = random.Random(seed)
    kv, s, tier = manager(pages=pool, host_pages=host_pages)
    common = [rng.randrange(1, 50) for _ in range(6)]
    convs = {0: (D1, list(common)), 1: (D1, list(common)), 2: (D2, list(common)), 3: (D1, [])}
    for _ in range(120):
        conv, grow, op = (
            rng.randrange(4),
            rng.randrange(1, 10),
            rng.choice(["turn", "turn", "evict", "other"]),
        )
        if op == "evict":
            kv.index.evict(grow, tier.save)
        elif op == "other":
            turn(kv, s, D2, [rng.randrange(50, 90) for _ in range(grow * 2)])
        else:
            digest, tokens = convs[conv]
            tokens += [rng.randrange(1, 50) for _ in range(grow)]
            if len(tokens) > (pool - 1) * P:  # the pool's size: start over after the conversation's prefix
                tokens[:] = [*tokens[: len(common) if conv < 3 else 0], *tokens[-grow:]]
            turn(kv, s, digest, tokens)
        assert tier.nbytes <= tier.max_bytes and tier.arena_bytes <= tier.max_bytes
        kv.allocator.check_integrity()
        kv.index.check_integrity()
