"""Edge cases of KV reuse that a mutation run over the reuse core found untested (issue 11, item 8).

Each test names the planted bug it kills. They drive the public API (`onnxgen.load`, `Model.session()`,
`Session.generate/evict`, `Model.close`, `Result.stats`, `load(max_kv_bytes=)`) wherever it can show the
behaviour, so they keep proving it when `engine/` is rebuilt; where only an internal shows it (the
decoder pool's memory, a backend that declines a rewind) the test says so. Every output is compared with
a fresh, reuse-free run: identical greedy tokens, logits within 1e-5 (norm-relative).
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import onnx
import pytest

import onnxgen
from onnxgen.engine.identity import make_identity
from tests.conftest import native_available
from tests.harness import loaded

BACKENDS = [
    "ort",
    pytest.param(
        "native", marks=pytest.mark.skipif(not native_available(), reason="native backend not importable")
    ),
]
TOL = 1e-5
N = 8
BASE = list(range(3, 60))


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)))


def load(path: Path, backend: str = "ort", **kw):
    opts = {"threads": 1} if backend == "ort" else {"kv_floor": 16}
    return onnxgen.load(str(path), backend=backend, **opts, **kw)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load(tiny_dir)


def run(session, prompt, **kw):
    return session.generate(prompt, max_new_tokens=N, output_logits=True, **kw)


def fresh(model, prompt, **kw):
    return model.generate(prompt, max_new_tokens=N, output_logits=True, reuse=False, **kw)


def check_same(result, ref):
    assert result.tokens == ref.tokens
    assert rel_err(result.logits, ref.logits) <= TOL


# --- a backend that can rewind, but declines this once ------------------------------------------------
# Planted bug: `reuse.apply` without `decoder.reset()` (or without `kept = 0`) after a declined rewind.
# The per-request decoders' path (ort); the native backend's paged pool shares pages and never rewinds.


def test_declined_rewind_on_a_rewinding_backend_resets_and_recomputes(tiny_dir, monkeypatch):
    from onnxgen.backends.ort.decoder import OrtDecoder as cls

    m = load(tiny_dir, "ort")
    s = m.session()
    r1 = run(s, BASE)
    original = cls.rewind_to
    declined: list[int] = []

    def rewind_to(self, n):
        if n != self.kv_len():  # the decoder says it can rewind (can_rewind is True), then declines
            declined.append(n)
            return False
        return original(self, n)

    monkeypatch.setattr(cls, "rewind_to", rewind_to)
    edited = BASE[:20] + [99] + BASE[21:]  # diverges at 20: the policy plans Rewind(20)
    r2 = run(s, edited)
    assert declined == [20], "the policy must have asked for a rewind (can_rewind is True)"
    assert r2.stats.reused_tokens == 0 and r2.stats.prefilled_tokens == len(edited)
    check_same(r2, fresh(m, edited))
    monkeypatch.undo()
    turn3 = edited + r2.tokens + [7]  # what the reset decoder now holds is reused exactly
    r3 = run(s, turn3)
    assert r3.stats.reused_tokens == len(edited) + len(r2.tokens) - 1
    check_same(r3, fresh(m, turn3))
    assert r1.tokens


# --- identity of extra inputs -------------------------------------------------------------------------
# Planted bugs: an input digested as `hash(repr(arr))` (numpy elides the middle of arrays over 1000
# elements, so arrays differing there collide), or without its dtype or its shape.


@pytest.fixture(scope="module")
def vision_path(tmp_path_factory):
    """A tiny package with a `pixel_values` input of any height and width ([batch, 3, h, w]; the graph
    reduces it to a zero, so it shapes the identity but not the logits)."""
    from onnxgen.convert.synthetic import SyntheticConfig, write_package

    cfg = SyntheticConfig(num_layers=2, context_length=512, extra_inputs=("pixel_values",))
    path = write_package(tmp_path_factory.mktemp("vision_any") / "pkg", cfg)
    graph_file = path / "model.onnx"
    proto = onnx.load(str(graph_file), load_external_data=False)
    (pv,) = [i for i in proto.graph.input if i.name == "pixel_values"]
    for axis, name in ((2, "height"), (3, "width")):
        dim = pv.type.tensor_type.shape.dim[axis]
        dim.ClearField("dim_value")
        dim.dim_param = name
    onnx.save(proto, str(graph_file))
    return path


@pytest.fixture(scope="module")
def vision_any_size(vision_path):
    return load(vision_path)


def test_large_attachments_differing_in_the_middle_reuse_nothing(vision_any_size):
    m = vision_any_size
    a = np.zeros((1, 3, 32, 32), dtype=np.float32)  # 3072 elements: repr() elides the middle
    b = a.copy()
    b[0, 1, 16, 16] = 1.0
    assert repr(a) == repr(b)  # the collision the digest must not have
    s = m.session()
    run(s, BASE, inputs={"pixel_values": a})
    r = run(s, BASE, inputs={"pixel_values": b})
    assert r.stats.reused_tokens == 0 and r.stats.prefilled_tokens == len(BASE)
    check_same(r, fresh(m, BASE, inputs={"pixel_values": b}))
    again = run(s, BASE, inputs={"pixel_values": b.copy()})  # equal content: reused
    assert again.stats.reused_tokens == len(BASE) - 1


def test_same_attachment_bytes_in_another_shape_reuse_nothing(vision_any_size):
    m = vision_any_size
    a = np.arange(192, dtype=np.float32).reshape(1, 3, 8, 8)
    b = a.reshape(1, 3, 4, 16)  # the same bytes, another image size
    assert a.tobytes() == b.tobytes()
    s = m.session()
    run(s, BASE, inputs={"pixel_values": a})
    r = run(s, BASE, inputs={"pixel_values": b})
    assert r.stats.reused_tokens == 0
    check_same(r, fresh(m, BASE, inputs={"pixel_values": b}))


def test_identity_digest_covers_dtype_shape_and_every_byte():
    """The identity itself (no graph accepts one input in two dtypes): equal bytes in another dtype or
    shape, and arrays beyond repr's 1000-element summary that differ in one middle element, all differ."""
    x = np.arange(16, dtype=np.float32)
    digest = make_identity([1, 2], {"pixel_values": x}, "pkg").digest
    assert digest is not None
    assert make_identity([1, 2], {"pixel_values": x.copy()}, "pkg").digest == digest
    assert make_identity([1, 2], {"pixel_values": x.view(np.int32)}, "pkg").digest != digest
    assert make_identity([1, 2], {"pixel_values": x.reshape(4, 4)}, "pkg").digest != digest
    big = np.zeros(5000, dtype=np.float64)
    other = big.copy()
    other[2500] = 1.0
    assert repr(big) == repr(other)
    assert make_identity([1], {"v": big}, "pkg").digest != make_identity([1], {"v": other}, "pkg").digest
    assert (
        make_identity([1], {"v": np.asfortranarray(np.eye(3))}, "pkg").digest
        == make_identity([1], {"v": np.eye(3)}, "pkg").digest
    )  # layout in memory is not content


# --- chunked prefill of a suffix that is an exact multiple of chunk_size ------------------------------
# Planted bug: `plan_chunks` dropping the last chunk when (end - start) % chunk_size == 0.


def test_prefill_of_exact_multiples_of_the_chunk_size_matches_unchunked(tiny_dir, tiny):
    m = load(tiny_dir, chunk_size=4)
    s = m.session()
    p1 = BASE[:16]  # 4 whole chunks from position 0
    r1 = run(s, p1)
    assert r1.stats.prefilled_tokens == 16
    check_same(r1, fresh(tiny, p1))
    held = len(p1) + len(r1.tokens) - 1
    turn2 = p1 + r1.tokens
    turn2 = turn2 + list(range(100, 100 + 12 - (len(turn2) - held)))  # a 12-token suffix: 3 whole chunks
    r2 = run(s, turn2)
    assert r2.stats.reused_tokens == held and r2.stats.prefilled_tokens == 12
    check_same(r2, fresh(tiny, turn2))


# --- one session, two threads ---------------------------------------------------------------------------
# Planted bug: `Session.generate` without its request lock.


class _Pause:
    """A logits processor that, on its first call (inside the request), waits up to `seconds` for
    `until` (the other thread's request finishing). Leaves the logits unchanged."""

    def __init__(self, inside: threading.Event, until: threading.Event, seconds: float) -> None:
        self.inside, self.until, self.seconds = inside, until, seconds
        self.calls = 0

    def __call__(self, logits, generated):
        self.calls += 1
        if self.calls == 1:
            self.inside.set()
            self.until.wait(self.seconds)
        return logits


def test_two_threads_on_one_session_run_one_after_the_other(tiny):
    s = tiny.session()
    inside, b_done = threading.Event(), threading.Event()
    results: dict[str, object] = {}
    errors: list[BaseException] = []

    def first():
        try:
            results["a"] = run(s, BASE, processors=[_Pause(inside, b_done, 1.0)])
        except BaseException as exc:
            errors.append(exc)

    def second():
        try:
            results["b"] = run(s, BASE)
        except BaseException as exc:
            errors.append(exc)
        finally:
            b_done.set()

    ta = threading.Thread(target=first)
    ta.start()
    assert inside.wait(60), "the first request never sampled"
    tb = threading.Thread(target=second)  # starts while the first request is inside the session
    tb.start()
    ta.join(60)
    tb.join(60)
    assert not errors, errors
    a, b = results["a"], results["b"]
    ref = fresh(tiny, BASE)
    check_same(a, ref)
    check_same(b, ref)
    # serialised: the second request ran after the first committed, so it reused the first's context
    assert a.stats.reused_tokens == 0 and b.stats.reused_tokens == len(BASE) - 1
    assert s.retained_tokens == len(BASE) + len(b.tokens) - 1


# --- evicted, or the engine closed, while a request runs ------------------------------------------------
# Planted bugs: the running request's decoder reachable from `evict` / `close` (state not taken on entry,
# or a pooled decoder handed out while still pooled).


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("action", ["evict", "close"])
def test_evict_or_close_during_a_request_leaves_it_untouched(tiny_dir, backend, action):
    m = load(tiny_dir, backend)
    m.generate(BASE[:8], max_new_tokens=2, reuse=False)  # leaves an idle decoder in the pool
    s = m.session()
    fired: list[int] = []

    def on_token(_piece):
        fired.append(s.evict() if action == "evict" else m.close() or 0)

    # 1. a session holding nothing: its request runs on a decoder from the pool
    r1 = run(s, BASE, on_token=on_token)
    assert fired, "the callback never ran: pick a prompt whose reply streams text"
    check_same(r1, fresh(m, BASE))
    # 2. a session holding a context: its request runs on the retained decoder
    turn2 = BASE + r1.tokens + [40, 41]
    if s.retained_tokens == 0:  # `close` after the commit of (1) is fine too: retain again
        run(s, BASE)
    fired.clear()
    r2 = run(s, turn2, on_token=on_token)
    assert fired and fired[0] == 0  # the running request holds the session's KV, not the session
    assert r2.stats.reused_tokens == len(BASE) + len(r1.tokens) - 1
    check_same(r2, fresh(m, turn2))
    turn3 = turn2 + r2.tokens + [42]
    r3 = run(s, turn3)  # the session is still usable, and what it reuses is right
    assert r3.stats.reused_tokens + r3.stats.prefilled_tokens == len(turn3)
    check_same(r3, fresh(m, turn3))


# --- one session alone over max_kv_bytes --------------------------------------------------------------
# Planted bug: `SessionRegistry.touch` only evicting *other* sessions.


def test_a_session_alone_over_max_kv_bytes_retains_nothing(tiny_dir, tiny):
    probe = tiny.session()
    run(probe, BASE)
    per = probe.kv_bytes()
    assert per > 0
    over = load(tiny_dir, max_kv_bytes=per - 1)
    s = over.session()
    r1 = run(s, BASE)
    assert s.retained_tokens == 0 and s.kv_bytes() == 0 and over.kv_stats()["retained_kv_bytes"] == 0
    r2 = run(s, BASE)
    assert r2.stats.reused_tokens == 0
    check_same(r2, r1)
    exact = load(tiny_dir, max_kv_bytes=per)  # at the bound is within it
    t = exact.session()
    run(t, BASE)
    assert t.kv_bytes() == per and exact.kv_stats()["retained_kv_bytes"] == per
    assert run(t, BASE).stats.reused_tokens == len(BASE) - 1


# --- the decoder pool empties what it takes back ---------------------------------------------------------
# Planted bug: `DecoderPool.release` keeping the decoder without emptying it. Per-request decoders (ort);
# the pool is internal, `Model.kv_stats()` shows its idle decoders.


def test_an_evicted_sessions_decoder_goes_back_to_the_pool_emptied(tiny_dir):
    engine, m = loaded(tiny_dir, backend="ort", threads=1)
    s = m.session()
    run(s, BASE)
    held = s.kv_bytes()
    assert held > 0
    idle_before = m.kv_stats()["idle_decoders"]
    released = []
    release = engine.pool.release
    engine.pool.release = lambda d: (released.append(d), release(d))  # a spy: what the eviction hands back
    assert s.evict() == held and s.kv_bytes() == 0
    engine.pool.release = release
    assert len(released) == 1 and m.kv_stats()["idle_decoders"] == idle_before + 1
    idle = engine.pool.acquire()
    assert idle is released[0]  # recycled, and emptied
    assert idle.kv_len() == 0
    engine.pool.release(idle)
    r = run(s, BASE)
    assert r.stats.reused_tokens == 0
    check_same(r, fresh(m, BASE))


# --- further survivors of benchmarks/mutation.py (docs/mutation.md) ---------------------------------------


def test_a_prompt_differing_at_its_first_token_reuses_nothing(tiny):
    s = tiny.session()
    run(s, BASE)
    other = [BASE[0] + 1, *BASE[1:]]  # every token equal but the first
    r = run(s, other)
    assert r.stats.reused_tokens == 0 and r.stats.prefilled_tokens == len(other)
    check_same(r, fresh(tiny, other))


def test_identity_digest_covers_input_names_and_raw_bytes():
    x = np.arange(4, dtype=np.float32)
    d = make_identity([1], {"a": x}, "pkg").digest
    assert d is not None and len(d) == 16  # blake2b-128 (REUSE.md invariant 4)
    assert make_identity([1], {"b": x}, "pkg").digest != d  # the same value under another input
    assert make_identity([1], {"a": x, "b": x}, "pkg").digest not in (d, None)
    raw = make_identity([1], {"a": b"\x00\x01"}, "pkg")
    assert raw.retainable
    assert make_identity([1], {"a": bytearray(b"\x00\x01")}, "pkg").digest == raw.digest
    assert make_identity([1], {"a": memoryview(b"\x00\x01")}, "pkg").digest == raw.digest
    assert make_identity([1], {"a": b"\x00\x02"}, "pkg").digest != raw.digest
    assert make_identity([1], {"a": b"\x00\x01\x00"}, "pkg").digest != raw.digest
    # bytes then a name, or a longer name: the fields cannot run into each other
    assert (
        make_identity([1], {"a": b"b", "c": b""}, "pkg").digest
        != make_identity([1], {"a": b"", "bc": b""}, "pkg").digest
    )
    # a value that spells the next input's header: only the length prefix tells the two apart
    two = make_identity([1], {"a": b"x", "b": b"y"}, "pkg").digest
    for spelled in (b"x\x00input\x00b\x00bytes\x00y", b"x\x00input\x00b\x00y"):
        assert make_identity([1], {"a": spelled}, "pkg").digest != two
    assert make_identity([1], {"a": x}, "pkg").digest != make_identity([1], {"a": x.tobytes()}, "pkg").digest
    assert (
        make_identity([1], {"a": 1.5}, "pkg").digest is None
        and not make_identity([1], {"a": 1.5}, "pkg").retainable
    )


def test_identity_digests_torch_tensors_by_dtype_shape_and_bytes():
    torch = pytest.importorskip("torch")
    t = torch.arange(6, dtype=torch.float32)
    d = make_identity([1], {"a": t}, "pkg").digest
    assert d is not None and make_identity([1], {"a": t.clone()}, "pkg").digest == d
    assert make_identity([1], {"a": t.view(2, 3)}, "pkg").digest != d
    assert make_identity([1], {"a": t.view(torch.int32)}, "pkg").digest != d
    u = t.clone()
    u[3] = 7.0
    assert make_identity([1], {"a": u}, "pkg").digest != d
    bf = torch.ones(3, dtype=torch.bfloat16)  # no numpy dtype: digested as raw bytes
    assert make_identity([1], {"a": bf}, "pkg").digest != make_identity([1], {"a": bf * 2}, "pkg").digest
    strided = t[::2]  # a view with strides: digested by content
    assert (
        make_identity([1], {"a": strided}, "pkg").digest
        == make_identity([1], {"a": strided.contiguous()}, "pkg").digest
    )


class _FakeDecoder:
    """The Decoder protocol's bookkeeping only: a length, reset/close counters, an optional broken reset."""

    backend, device, can_rewind = "fake", "cpu", True

    def __init__(self, length: int = 0, broken: bool = False) -> None:
        self.length, self.broken = length, broken
        self.resets = self.closes = 0

    def kv_len(self) -> int:
        return self.length

    def reset(self) -> None:
        if self.broken:
            raise RuntimeError("reset failed")
        self.resets += 1
        self.length = 0

    def kv_bytes(self) -> int:
        return self.length * 8

    def close(self) -> None:
        self.closes += 1


def test_decoder_pool_recycles_emptied_decoders_and_closes_the_rest():
    """Internal (`engine/session.py::DecoderPool`): release empties and keeps up to `keep` decoders, closes
    surplus and broken ones; acquire hands each kept decoder out once; close closes the idle ones."""
    try:
        from onnxgen.engine.slots import DecoderPool
    except ModuleNotFoundError:  # before the batching engine
        from onnxgen.engine.session import DecoderPool

    made: list[_FakeDecoder] = []

    def factory() -> _FakeDecoder:
        made.append(_FakeDecoder())
        return made[-1]

    pool = DecoderPool(factory, keep=2)
    a, b, c = _FakeDecoder(5), _FakeDecoder(6), _FakeDecoder(7)
    pool.release(None)  # nothing to do
    for d in (a, b, c):
        pool.release(d)
    assert (a.length, b.length, c.length) == (0, 0, 0) and (a.resets, b.resets, c.resets) == (1, 1, 1)
    assert (a.closes, b.closes, c.closes) == (0, 0, 1)  # kept two, closed the third
    got = {id(pool.acquire()), id(pool.acquire())}
    assert got == {id(a), id(b)} and made == []
    fresh_one = pool.acquire()
    assert made == [fresh_one]  # the pool was empty: a new decoder
    broken = _FakeDecoder(3, broken=True)
    pool.release(broken)
    assert broken.closes == 1 and pool.acquire() is not broken
    pool.release(a)
    pool.close()
    assert a.closes == 1 and pool.acquire() is made[-1] and len(made) == 3


def test_sessions_keep_their_names_and_unnamed_ones_get_distinct_names(tiny):
    assert tiny.session("chat-7").name == "chat-7"
    a, b = tiny.session(), tiny.session()
    assert a.name and b.name and a.name != b.name
    assert tiny.default_session.name == "default"
    closed = tiny.session("gone")
    closed.close()
    with pytest.raises(onnxgen.errors.InvalidRequest, match="gone is closed"):
        closed.generate(BASE, max_new_tokens=1)


class _Opaque:
    """An input the identity cannot digest (the backend still reads it as an array)."""

    def __init__(self, arr):
        self.arr = arr

    def __array__(self, dtype=None, copy=None):
        return self.arr


def test_failed_and_unretainable_requests_hand_their_decoder_back_emptied(vision_path):
    """Internal (a spy on the decoder pool): a request that fails, or whose context cannot be retained,
    gives its decoder back to the pool at once, emptied; the session holds nothing."""
    engine, m = loaded(vision_path, backend="ort", threads=1)
    s = m.session()
    released = []
    release = engine.pool.release
    engine.pool.release = lambda d: (released.append(d), release(d))
    try:
        run(s, BASE, inputs={"pixel_values": np.zeros((1, 3, 8, 8), np.float32)})
        assert released == [] and s.retained_tokens > 0
        with pytest.raises(onnxgen.errors.MissingRequiredInput) as failure:
            run(s, BASE)  # no pixel_values: fails in the backend, after the reuse plan
        assert failure.value is not None  # the traceback (and its frames) still alive here
        assert len(released) == 1 and released[0].kv_len() == 0 and s.retained_tokens == 0
        run(s, BASE, inputs={"pixel_values": _Opaque(np.zeros((1, 3, 8, 8), np.float32))})
        assert len(released) == 2 and released[1].kv_len() == 0 and s.retained_tokens == 0
        s.generate(
            BASE, max_new_tokens=2, reuse=False, inputs={"pixel_values": np.zeros((1, 3, 8, 8), np.float32)}
        )
        assert len(released) == 3 and released[2].kv_len() == 0
    finally:
        engine.pool.release = release


# --- the LRU bound on retained sessions (load(max_sessions=, max_kv_bytes=)) ----------------------------


def _retaining(model, n):
    return [model.session() for _ in range(n)]


def test_lru_order_follows_use_and_sessions_holding_nothing_do_not_count(tiny_dir):
    m = load(tiny_dir, max_sessions=2)
    a, b, c = _retaining(m, 3)
    run(a, BASE)
    run(b, BASE)
    run(a, BASE)  # a is now the most recently used
    run(c, BASE)
    assert (a.retained_tokens > 0, b.retained_tokens > 0, c.retained_tokens > 0) == (True, False, True)
    m = load(tiny_dir, max_sessions=2)
    a, b, c = _retaining(m, 3)
    run(a, BASE)
    run(b, BASE)
    b.evict()  # b stays registered but holds nothing: it must not count against max_sessions
    run(c, BASE)
    assert (a.retained_tokens > 0, b.retained_tokens > 0, c.retained_tokens > 0) == (True, False, True)
    assert m.kv_stats()["retained_kv_bytes"] == a.kv_bytes() + c.kv_bytes()


def test_max_kv_bytes_evicts_only_as_many_sessions_as_needed(tiny_dir, tiny):
    probe = tiny.session()
    run(probe, BASE)
    per = probe.kv_bytes()
    m = load(tiny_dir, max_kv_bytes=2 * per)  # two fit exactly
    a, b, c = _retaining(m, 3)
    run(a, BASE)
    run(b, BASE)
    assert a.kv_bytes() == per and b.kv_bytes() == per and m.kv_stats()["retained_kv_bytes"] == 2 * per
    run(c, BASE)  # 3 * per: evict the least recently used one, and only it
    assert (a.retained_tokens, b.retained_tokens > 0, c.retained_tokens > 0) == (0, True, True)
    assert m.kv_stats()["retained_kv_bytes"] == 2 * per


def test_clear_and_close_drop_the_context_and_a_closed_session_is_collectable(tiny):
    import gc
    import weakref

    s = tiny.session()
    run(s, BASE)
    assert s.retained_tokens > 0
    s.clear()
    assert s.retained_tokens == 0 and s.kv_bytes() == 0
    assert run(s, BASE).stats.reused_tokens == 0  # still usable; nothing reused
    s.close()
    assert s.closed and s.retained_tokens == 0
    ref = weakref.ref(s)
    del s
    gc.collect()
    assert ref() is None  # the engine keeps no reference to a closed session


# --- the paged pool (native backend) ----------------------------------------------------------------------

needs_native = pytest.mark.skipif(not native_available(), reason="native backend not importable")


@needs_native
def test_a_paged_sessions_kv_bytes_are_its_pages(tiny_dir):
    from onnxgen.kv.storage import page_bytes

    m = load(tiny_dir, "native")
    stats = m.kv_stats()
    assert stats["paged"]
    page = stats["page_size"]
    s = m.session()
    run(s, BASE)
    spec = m.spec
    per_page = page_bytes(spec.num_layers, page, spec.num_kv_heads, spec.head_size, 4)  # fp32 KV
    assert s.retained_tokens >= len(BASE)  # the session pins its context
    assert s.kv_bytes() == -(-s.retained_tokens // page) * per_page > 0
    assert m.kv_stats()["retained_kv_bytes"] >= s.kv_bytes()


@needs_native
def test_a_reuse_false_request_leaves_nothing_in_the_paged_cache(tiny_dir):
    m = load(tiny_dir, "native")
    free = m.kv_stats()["pages_free"]
    first = m.generate(BASE, max_new_tokens=N, output_logits=True, reuse=False)
    assert first.stats.reused_tokens == 0
    assert m.kv_stats()["pages_free"] == free  # its pages went back to the pool
    r = run(m.session(), BASE)  # nothing of the reuse=False request was indexed
    assert r.stats.reused_tokens == 0
    check_same(r, first)


@needs_native
def test_paged_pool_stats_follow_pins_sharing_and_close(tiny_dir):
    m = load(tiny_dir, "native")
    total = m.kv_stats()["pages_total"]
    a, b = m.session(), m.session()
    run(a, BASE)
    run(b, BASE + [70, 71])  # shares BASE's full pages with a
    st = m.kv_stats()
    assert st["pinned_sessions"] == 2
    assert st["pages_shared"] == 0  # between requests only the index holds pages: nothing is shared
    assert st["pages_used"] == st["pages_indexed"] and st["pages_free"] == total - st["pages_used"]
    during: list[dict] = []
    c = m.session()
    run(c, BASE + [80], on_token=lambda _p: during.append(m.kv_stats()))  # reads the pool mid-request
    assert during, "nothing streamed"
    full = len(BASE) // st["page_size"]
    assert during[0]["pages_shared"] == full  # BASE's full pages: held by the index and by c's request
    c.close()
    a.evict()
    assert m.kv_stats()["pinned_sessions"] == 1
    b.close()
    assert m.kv_stats()["pinned_sessions"] == 0
    m.close()
    after = m.kv_stats()
    assert after["pages_free"] == total and after["pages_indexed"] == 0  # close drops every unpinned page


def test_a_one_token_context_counts_against_max_sessions(tiny_dir):
    m = load(tiny_dir, max_sessions=1)
    a, b = m.session(), m.session()
    a.generate([5], max_new_tokens=1)
    assert a.retained_tokens == 1
    b.generate([6], max_new_tokens=1)
    assert (a.retained_tokens, b.retained_tokens) == (0, 1)


@needs_native
def test_paged_prefix_counters_count_lookups_and_hits(tiny_dir):
    m = load(tiny_dir, "native")
    page = m.kv_stats()["page_size"]
    before = m.kv_stats()
    assert (before["prefix_lookups"], before["prefix_lookup_tokens"], before["prefix_hit_tokens"]) == (
        0,
        0,
        0,
    )
    s = m.session()
    run(s, BASE)
    r = run(s, BASE + [70, 71])
    st = m.kv_stats()
    assert st["prefix_lookups"] == 2 and st["prefix_lookup_tokens"] == 2 * len(BASE) + 2
    assert st["prefix_hit_tokens"] == r.stats.reused_tokens >= (len(BASE) // page) * page
    m.generate(BASE, max_new_tokens=2, reuse=False)  # reads no cache: not a lookup
    assert m.kv_stats()["prefix_lookups"] == 2
