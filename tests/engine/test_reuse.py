"""KV reuse across requests (docs/reuse.md): every case asserts that work was skipped AND that the output
equals a fresh, reuse-free run (identical greedy tokens; logits within tolerance), on both backends:
ort (one decoder per request, a session retains its decoder) and native (a paged pool shared by every
request, a session pins its context in the prefix index). Each test's sessions get their own salt, so
they share nothing with other tests' (with paged KV, sessions under one salt share common prefixes:
`test_sessions_under_one_salt_share_prefix_pages`)."""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import onnxgen
from onnxgen.engine.identity import make_identity
from onnxgen.engine.reuse import Keep, Reset, Rewind, plan, shared_prefix
from onnxgen.engine.slots import DecoderPool
from onnxgen.errors import Cancelled, MissingRequiredInput
from tests.conftest import native_available
from tests.harness import loaded

BACKENDS = [
    "ort",
    pytest.param(
        "native", marks=pytest.mark.skipif(not native_available(), reason="native backend not importable")
    ),
]
TOL = 1e-5
N = 8  # tokens generated per request


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)))


@pytest.fixture(scope="module", params=BACKENDS)
def model(request, tiny_dir):
    opts = {"threads": 1} if request.param == "ort" else {"kv_floor": 16}
    return onnxgen.load(str(tiny_dir), backend=request.param, **opts)


def forward_of(model):
    """(class, method) that runs the model's forwards (to inject failures): a decoder's `forward`, or the
    batched runner's `run` with paged KV."""
    if model.paged:
        from onnxgen.backends.native.runner import NativeRunner

        return NativeRunner, "run"
    if model.backend == "ort":
        from onnxgen.backends.ort.decoder import OrtDecoder

        return OrtDecoder, "forward"
    from onnxgen.backends.native.decoder import NativeDecoder

    return NativeDecoder, "forward"


def session(model):
    """A session with a salt of its own (shares no KV with other sessions)."""
    return model.session(salt=uuid.uuid4().hex)


def fresh(model, prompt, **kw):
    return model.generate(prompt, max_new_tokens=N, output_logits=True, reuse=False, **kw)


def check_same(result, ref):
    assert result.tokens == ref.tokens
    assert rel_err(result.logits, ref.logits) <= TOL


def run(session, prompt, **kw):
    return session.generate(prompt, max_new_tokens=N, output_logits=True, **kw)


BASE = list(range(3, 60))


# --- the pure policy ------------------------------------------------------------------------


def test_plan_table():
    assert plan(0, 10, True) == Reset()
    assert plan(10, 10, True) == Keep()
    assert plan(4, 10, True) == Rewind(4)
    assert plan(4, 10, False) == Reset()
    assert plan(12, 10, True) == Keep()  # shared beyond the cache is capped by kv_len
    assert plan(5, 0, True) == Reset()


def test_shared_prefix_caps_and_identity():
    a = make_identity([1, 2, 3, 4], None, "pkg")
    assert shared_prefix(a, make_identity([1, 2, 3, 4], None, "pkg")) == 3  # at least one token computed
    assert shared_prefix(a, make_identity([1, 2, 9], None, "pkg")) == 2
    assert shared_prefix(a, make_identity([1, 2, 3, 4], None, "other")) == 0
    x = make_identity([1, 2, 3], {"pixel_values": np.zeros(3)}, "pkg")
    y = make_identity([1, 2, 3], {"pixel_values": np.ones(3)}, "pkg")
    assert shared_prefix(x, y) == 0
    assert make_identity([1, 2], {"pixel_values": object()}, "pkg").digest is None
    assert shared_prefix(None, a) == 0


# --- the cases of docs/reuse.md ----------------------------------------------------------------------


def test_extend_prefills_only_new_tokens(model):
    s = session(model)
    r1 = run(s, BASE)
    assert r1.stats.reused_tokens == 0 and r1.stats.prefilled_tokens == len(BASE)
    turn2 = BASE + r1.tokens + [70, 71, 72, 73]
    r2 = run(s, turn2)
    held = len(BASE) + len(r1.tokens) - 1  # the last generated token was never fed
    assert r2.stats.reused_tokens == held
    assert r2.stats.prefilled_tokens == len(turn2) - held
    check_same(r2, fresh(model, turn2))


def test_identical_prompt_twice_and_strict_prefix(model):
    s = session(model)
    r1 = run(s, BASE)
    r2 = run(s, BASE)
    assert r2.stats.reused_tokens == len(BASE) - 1 and r2.stats.prefilled_tokens == 1
    check_same(r2, r1)
    prefix = BASE[:30]
    r3 = run(s, prefix)
    assert r3.stats.reused_tokens == 29 and r3.stats.prefilled_tokens == 1
    check_same(r3, fresh(model, prefix))


def test_edited_earlier_turn_reuses_up_to_the_edit(model):
    s = session(model)
    r1 = run(s, BASE)
    edited = BASE[:20] + [99] + BASE[21:] + r1.tokens + [70]
    r2 = run(s, edited)
    assert r2.stats.reused_tokens == 20 and r2.stats.prefilled_tokens == len(edited) - 20
    check_same(r2, fresh(model, edited))


def test_forked_conversation_and_stripped_reasoning(model):
    s = session(model)
    think = [200, 201, 202, 203, 204]  # a "reasoning block" the client strips from history
    r1 = run(s, BASE + think)
    branch_a = BASE + [80, 81]
    ra = run(s, branch_a)
    assert ra.stats.reused_tokens == len(BASE)
    check_same(ra, fresh(model, branch_a))
    branch_b = BASE + [90, 91, 92]
    rb = run(s, branch_b)
    assert rb.stats.reused_tokens == len(BASE)
    check_same(rb, fresh(model, branch_b))
    assert r1.tokens  # sanity


def test_interleaved_sessions_a_b_a(model):
    a, b = session(model), session(model)
    pa = BASE
    pb = list(range(100, 140))
    ra1 = run(a, pa)
    rb1 = run(b, pb)
    pa2 = pa + ra1.tokens + [5, 6]
    ra2 = run(a, pa2)
    assert ra2.stats.reused_tokens == len(pa) + len(ra1.tokens) - 1
    check_same(ra2, fresh(model, pa2))
    pb2 = pb + rb1.tokens + [7]
    rb2 = run(b, pb2)
    assert rb2.stats.reused_tokens == len(pb) + len(rb1.tokens) - 1
    check_same(rb2, fresh(model, pb2))


def test_reuse_false_neither_reads_nor_changes_retained_state(model):
    s = session(model)
    run(s, BASE)
    held = s.retained_tokens
    other = list(range(150, 190))
    r = s.generate(other, max_new_tokens=N, reuse=False)
    assert r.stats.reused_tokens == 0
    assert s.retained_tokens == held
    r2 = run(s, BASE)
    assert r2.stats.reused_tokens == len(BASE) - 1


class NoRewind:
    """A decoder that declines every rewind (like a backend that cannot truncate its cache)."""

    def __init__(self, inner):
        self._inner = inner
        self.backend, self.device, self.can_rewind = inner.backend, inner.device, False
        self.declined = 0

    def rewind_to(self, n):
        if n != self._inner.kv_len():
            self.declined += 1
        return n == self._inner.kv_len()

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.fixture(scope="module", params=BACKENDS)
def decoder_model(request, tiny_dir):
    """A model that runs one decoder per request (paged KV off)."""
    opts = {"threads": 1} if request.param == "ort" else {"kv_floor": 16}
    return loaded(tiny_dir, backend=request.param, paged=False, **opts)


def test_backend_that_declines_rewind_resets(decoder_model, monkeypatch):
    engine, model = decoder_model
    inner = engine.pool
    monkeypatch.setattr(engine.executor, "pool", DecoderPool(lambda: NoRewind(inner.acquire())))
    s = session(model)
    r1 = run(s, BASE)
    edited = BASE[:20] + [99] + BASE[21:]
    r2 = run(s, edited)  # would be Rewind(20): the policy plans Reset since can_rewind is False
    assert r2.stats.reused_tokens == 0 and r2.stats.prefilled_tokens == len(edited)
    check_same(r2, fresh(model, edited))
    extend = edited + r2.tokens + [7]
    r3 = run(s, extend)  # Keep still works
    assert r3.stats.reused_tokens == len(edited) + len(r2.tokens) - 1
    check_same(r3, fresh(model, extend))
    assert r1.tokens


# --- identity: attachments ------------------------------------------------------------------


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    from onnxgen.convert.synthetic import SyntheticConfig, write_package

    cfg = SyntheticConfig(num_layers=2, context_length=512, extra_inputs=("pixel_values",))
    path = write_package(tmp_path_factory.mktemp("vision") / "pkg", cfg)
    return onnxgen.load(str(path), backend="ort", threads=1)


def pix(v: float) -> np.ndarray:
    return np.full((1, 3, 8, 8), v, dtype=np.float32)


def test_missing_required_input_is_typed_and_drops_state(vision):
    s = vision.session()
    run(s, BASE, inputs={"pixel_values": pix(0.5)})
    assert s.retained_tokens > 0
    with pytest.raises(MissingRequiredInput, match="pixel_values"):
        run(s, BASE)
    assert s.retained_tokens == 0


def test_same_tokens_different_attachment_reuses_nothing(vision):
    s = vision.session()
    run(s, BASE, inputs={"pixel_values": pix(0.5)})
    r = run(s, BASE, inputs={"pixel_values": pix(0.25)})
    assert r.stats.reused_tokens == 0
    r = run(s, BASE, inputs={"pixel_values": pix(0.25)})
    assert r.stats.reused_tokens == len(BASE) - 1
    r_bytes = run(s, BASE, inputs={"pixel_values": pix(0.25)})
    assert r_bytes.stats.reused_tokens == len(BASE) - 1


class Opaque:
    """An input value the identity cannot digest (but the backend can still consume)."""

    def __init__(self, arr):
        self.arr = arr

    def __array__(self, dtype=None, copy=None):
        return self.arr


def test_undigestable_input_is_never_retained_seed_regression(vision):
    """The seed PR's bug: a request whose identity cannot be digested overwrote the KV while the
    session still described an earlier request. Here the session must hold nothing afterwards,
    and the next request (identical to the earlier one) must reuse nothing."""
    s = vision.session()
    first = run(s, BASE, inputs={"pixel_values": pix(0.5)})
    assert s.retained_tokens == len(BASE) + len(first.tokens) - 1
    other = list(range(100, 160))
    run(s, other, inputs={"pixel_values": Opaque(pix(0.5))})
    assert s.retained_tokens == 0  # no stale descriptor beside the new KV
    again = run(s, BASE, inputs={"pixel_values": pix(0.5)})
    assert again.stats.reused_tokens == 0
    check_same(
        again,
        vision.generate(
            BASE, max_new_tokens=N, output_logits=True, reuse=False, inputs={"pixel_values": pix(0.5)}
        ),
    )


# --- failures and cancellation ---------------------------------------------------------------


class Boom(RuntimeError):
    pass


def _failing_forward(monkeypatch, model, fail_at: int):
    calls = {"n": 0}
    cls, name = forward_of(model)
    original = getattr(cls, name)

    def forward(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise Boom(f"injected failure at forward call {fail_at}")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, forward)
    return calls


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_injected_failure_drops_state_and_next_request_is_correct(model, tiny_dir, monkeypatch, where):
    opts = {"threads": 1} if model.backend == "ort" else {"kv_floor": 16}
    chunked = onnxgen.load(str(tiny_dir), backend=model.backend, chunk_size=2, **opts)
    s = chunked.session()
    r1 = run(s, BASE)
    turn2 = BASE + r1.tokens + [40, 41, 42, 43, 44, 45]  # 7 new tokens: chunks of 2 -> 4 prefill calls
    calls = _failing_forward(monkeypatch, chunked, 2 if where == "prefill" else 6)
    with pytest.raises(Boom, match="injected failure"):
        run(s, turn2)
    monkeypatch.undo()
    assert calls["n"] >= 2
    assert s.retained_tokens == 0
    r3 = run(s, turn2)
    assert r3.stats.reused_tokens == committed_before(chunked, BASE, r1)
    check_same(r3, fresh(model, turn2))


def test_cancelled_stream_drops_state(model):
    s = session(model)
    r1 = run(s, BASE)
    cancel = threading.Event()

    def on_token(_piece):
        cancel.set()

    turn2 = BASE + r1.tokens + [40]
    with pytest.raises(Cancelled):
        s.generate(turn2, max_new_tokens=N, on_token=on_token, cancel=cancel)
    assert s.retained_tokens == 0
    r3 = run(s, turn2)
    assert r3.stats.reused_tokens == committed_before(model, BASE, r1)
    check_same(r3, fresh(model, turn2))


def committed_before(model, prompt, result):
    """What the next request may reuse after a failed or cancelled one: with decoders nothing (the failed
    request held the only copy); with paged KV exactly turn 1's committed context, still indexed though no
    longer pinned, and none of the failed request's positions (they were never indexed)."""
    return len(prompt) + len(result.tokens) - 1 if model.paged else 0


def test_lru_bounds_retained_sessions(tiny_dir):
    m = onnxgen.load(str(tiny_dir), backend="ort", threads=1, max_sessions=2)
    sessions = [m.session() for _ in range(3)]
    for i, s in enumerate(sessions):
        run(s, [i + 3, *BASE])
    assert [s.retained_tokens > 0 for s in sessions] == [False, True, True]
    r = run(sessions[0], [3, *BASE])
    assert r.stats.reused_tokens == 0  # evicted: reuses nothing, still works
    per = sessions[2].kv_bytes()
    assert per > 0 and sessions[1].retained_tokens == 0  # sessions[1] was least recently used
    m2 = onnxgen.load(str(tiny_dir), backend="ort", threads=1, max_kv_bytes=per + 1)
    a, b = m2.session(), m2.session()
    run(a, BASE)
    run(b, BASE)
    assert a.retained_tokens == 0 and b.retained_tokens > 0


# --- property test ------------------------------------------------------------------------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("extend"), st.integers(1, 6)),
        st.tuples(st.just("repeat"), st.just(0)),
        st.tuples(st.just("prefix"), st.integers(1, 40)),
        st.tuples(st.just("edit"), st.integers(0, 40)),
        st.tuples(st.just("switch"), st.integers(0, 1)),
        st.tuples(st.just("fail"), st.integers(1, 3)),
        st.tuples(st.just("cancel"), st.integers(0, 1)),
    ),
    min_size=2,
    max_size=7,
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
@example(ops=[("repeat", 0), ("repeat", 0), ("cancel", 1)])  # EOS before any streamed text (was flaky)
@example(
    ops=[("repeat", 0), ("edit", 8), ("extend", 1), ("cancel", 1)]
)  # text only in the final flush (seed 28)
def test_random_request_sequences_match_fresh_runs(model, ops):
    sessions = [session(model), session(model)]
    history = [list(BASE), list(range(100, 130))]
    held: list[list[int]] = [[], []]  # what each session's cache holds (its last successful context)
    cur = 0
    for op, arg in ops:
        s, prompt = sessions[cur], history[cur]
        if op == "switch":
            cur = arg
            continue
        if op == "extend":
            prompt = prompt + list(range(200, 200 + arg))
        elif op == "prefix":
            prompt = prompt[: max(1, min(arg, len(prompt)))]
        elif op == "edit":
            i = min(arg, len(prompt) - 1)
            prompt = prompt[:i] + [250] + prompt[i + 1 :]
        if op == "fail":
            cls, name = forward_of(model)
            original = getattr(cls, name)
            count = {"n": 0}

            def forward(self, *args, _o=original, _c=count, _at=arg, **kwargs):
                _c["n"] += 1
                if _c["n"] == _at:
                    raise Boom("injected")
                return _o(self, *args, **kwargs)

            setattr(cls, name, forward)
            try:
                r = run(s, prompt)  # the request may end (EOS) before the failing call
            except Boom:
                assert s.retained_tokens == 0
                held[cur] = []
                continue
            finally:
                setattr(cls, name, original)
            check_same(r, fresh(model, prompt))
            history[cur] = prompt + r.tokens
            held[cur] = prompt + r.tokens[:-1]
            continue
        if op == "cancel":  # arg 0: cancelled before the request starts; 1: on its first streamed text
            ev = threading.Event()
            if arg == 0:
                ev.set()
                with pytest.raises(Cancelled):
                    s.generate(prompt, max_new_tokens=N, cancel=ev)
                assert s.retained_tokens == 0
                held[cur] = []
                continue
            streamed: list[str] = []
            try:
                r = run(s, prompt, on_token=lambda p, e=ev, out=streamed: (out.append(p), e.set()), cancel=ev)
            except Cancelled:
                assert s.retained_tokens == 0
                held[cur] = []
                continue
            # NOTE: not cancelled, so no text was streamed while a step was still due: EOS or the length limit
            # came first, or the detokenizer held every byte back until the final flush (whose text set the
            # event after the last step). An ordinary, complete request.
            assert "".join(streamed) == r.text
            check_same(r, fresh(model, prompt))
            history[cur] = prompt + r.tokens
            held[cur] = prompt + r.tokens[:-1]
            continue
        assert s.retained_tokens == len(held[cur])
        own = min(_lcp(held[cur], prompt), len(prompt) - 1)  # what the session's own context supplies
        r = run(s, prompt)
        if model.paged:  # pages of the session's earlier contexts may still be indexed: at least its own
            assert own <= r.stats.reused_tokens <= len(prompt) - 1
        else:
            assert r.stats.reused_tokens == own
        assert r.stats.reused_tokens + r.stats.prefilled_tokens == len(prompt)
        check_same(r, fresh(model, prompt))
        history[cur] = prompt + r.tokens
        held[cur] = prompt + r.tokens[:-1]


def _lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.skipif(not native_available(), reason="native backend not importable")
def test_capacity_bucket_growth_during_one_turn(tiny_dir):
    """Native KV buckets (floor 16 here): turn 1 ends in a small bucket; turn 2 grows the cache through
    several power-of-two buckets in one request and still equals a fresh run."""
    model = onnxgen.load(str(tiny_dir), backend="native", kv_floor=16, paged=False)
    spec = model.spec
    per_position = 2 * spec.num_layers * spec.num_kv_heads * spec.head_size * 4  # K and V, fp32
    s = session(model)
    short = BASE[:12]
    r1 = run(s, short)
    cap1 = s.kv_bytes() // per_position
    assert s.retained_tokens <= cap1 < 2 * max(s.retained_tokens, 16)  # the smallest bucket that holds it
    turn2 = short + r1.tokens + [int(t) % 300 + 3 for t in range(200, 420)]
    r2 = run(s, turn2)
    assert r2.stats.reused_tokens == len(short) + len(r1.tokens) - 1
    assert r2.stats.prefilled_tokens == len(turn2) - r2.stats.reused_tokens
    check_same(r2, fresh(model, turn2))
    cap2 = s.kv_bytes() // per_position
    assert s.retained_tokens <= cap2 < 2 * s.retained_tokens and cap2 >= 4 * cap1  # grew by >= 2 buckets
