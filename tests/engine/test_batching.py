"""Continuous batching over the paged pool (native backend, CPU): batched requests give exactly what each
gives alone, prefixes are shared across sessions under one salt and never across salts, and a pool that
runs out of pages makes requests wait (or be preempted and recomputed), never fail or corrupt."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import onnxgen
from onnxgen.errors import Cancelled
from tests.conftest import native_available
from tests.harness import loaded, stepper

pytestmark = pytest.mark.skipif(not native_available(), reason="native backend not importable")

TOL = 1e-5
PAGE = 16


def per_token_bytes(spec: Any) -> int:
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_size * 4  # K and V, fp32


@pytest.fixture(scope="module")
def alone_model(tiny_dir: Path) -> Any:
    """The reference: one request at a time, computed from scratch (`reuse=False`)."""
    return onnxgen.load(str(tiny_dir), backend="native", paged=False, kv_floor=16)


def alone(model: Any, prompt: list[int], n: int) -> Any:
    return model.generate(prompt, max_new_tokens=n, output_logits=True, reuse=False)


def same(got: Any, ref: Any) -> None:
    assert got.tokens == ref.tokens
    d = np.linalg.norm(got.logits - ref.logits, axis=-1) / np.linalg.norm(ref.logits, axis=-1)
    assert float(d.max()) <= TOL


def check_pool(model: Any) -> None:
    kv = model.executor.kv
    kv.allocator.check_integrity()
    kv.index.check_integrity()
    stats = model.kv_stats()
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["pages_used"] == len(kv.index.pages()), "every page in use is indexed: no request leaked one"


# --- batched == alone, under random arrivals, cancels, forks, edits, shared prefixes, preemption -------

ARRIVALS = st.lists(
    st.fixed_dictionaries(
        {
            "at": st.integers(0, 6),  # the step at which it arrives
            "base": st.integers(0, 2),  # which shared prefix it starts from
            "cut": st.integers(0, 70),  # keep this much of the prefix (a fork or an edit point)
            "edit": st.booleans(),  # change the token at the cut
            "tail": st.integers(1, 30),  # new tokens after it
            "n": st.integers(1, 8),  # tokens to generate
            "cancel": st.one_of(st.none(), st.integers(0, 8)),  # cancelled at this step after arriving
            "salt": st.sampled_from([None, "b"]),
        }
    ),
    min_size=1,
    max_size=7,
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arrivals=ARRIVALS, small_pool=st.booleans())
def test_batched_requests_equal_each_request_alone(
    tiny_dir: Path, alone_model: Any, arrivals: list[dict], small_pool: bool
) -> None:
    spec = alone_model.spec
    # a small pool (20 pages = 320 tokens) forces requests to wait and running ones to be preempted
    kv_bytes = (20 if small_pool else 400) * PAGE * per_token_bytes(spec)
    model = stepper(tiny_dir, backend="native", kv_bytes=kv_bytes, max_running=4, max_batch_tokens=64)
    rng = np.random.default_rng(len(arrivals))
    bases = [rng.integers(3, spec.vocab_size - 1, size=70).tolist() for _ in range(3)]
    pending: list[tuple[dict, list[int], Any, threading.Event]] = []
    step = 0
    todo = sorted(arrivals, key=lambda a: a["at"])
    while todo or any(not p[2].done() for p in pending):
        while todo and todo[0]["at"] <= step:
            a = todo.pop(0)
            prompt = bases[a["base"]][: a["cut"]]
            if a["edit"] and prompt:
                prompt[-1] = (prompt[-1] + 7) % spec.vocab_size
            prompt = prompt + rng.integers(3, spec.vocab_size - 1, size=a["tail"]).tolist()
            ev = threading.Event()
            h = model.submit(prompt, max_new_tokens=a["n"], output_logits=True, cancel=ev, salt=a["salt"])
            pending.append((a, prompt, h, ev))
        for a, _, h, ev in pending:
            if a["cancel"] is not None and step >= a["at"] + a["cancel"] and not h.done():
                ev.set()
        model.step()
        step += 1
        assert step < 10_000, "the engine made no progress"
    for a, prompt, h, ev in pending:
        if ev.is_set() and h.error is not None:
            with pytest.raises(Cancelled):
                h.result()
            continue
        same(h.result(), alone(alone_model, prompt, a["n"]))
    check_pool(model)


# --- sharing --------------------------------------------------------------------------------------------


def test_eight_sessions_under_one_system_prompt_hold_one_copy(tiny_dir: Path) -> None:
    model = stepper(tiny_dir, backend="native")
    rng = np.random.default_rng(7)
    system = rng.integers(3, 380, size=500).tolist()  # 31 full pages + 4 positions of page 31
    turns = [rng.integers(3, 380, size=5 + i).tolist() for i in range(8)]
    sessions = [model.session(salt="team") for _ in range(8)]
    results = []
    for s, turn in zip(sessions, turns, strict=True):
        results.append(s.generate(system + turn, max_new_tokens=4, temperature=0))
    assert results[0].stats.reused_tokens == 0
    assert all(r.stats.reused_tokens == 500 for r in results[1:]), [r.stats.reused_tokens for r in results]
    stats = model.kv_stats()
    # the 31 full pages of the system prompt once, and each session's own pages from page 31 on: its 4
    # system positions (copied), its turn and its reply but the last token
    own = [-(-(4 + len(t) + len(r.tokens) - 1) // PAGE) for t, r in zip(turns, results, strict=True)]
    assert stats["pages_used"] == 31 + sum(own)
    assert stats["pages_indexed"] == stats["pages_used"] and stats["pinned_sessions"] == 8
    assert stats["prefix_hit_tokens"] == 7 * 500
    other = model.session(salt="another-tenant")
    r = other.generate(system + turns[0], max_new_tokens=4, temperature=0)
    assert r.stats.reused_tokens == 0 and r.tokens == results[0].tokens, "another salt shares nothing"
    check_pool(model)


def test_requests_arriving_together_under_one_system_prompt_compute_it_once(
    tiny_dir: Path, alone_model: Any
) -> None:
    """Eight requests under one 500-token system prompt submitted at once: the first computes it, the others
    wait for that step (`PagedKV.defer`) and then share its 31 full pages while it still runs (in-flight, not
    yet indexed); each gets what it gets alone. Under another salt nothing is shared."""
    model = stepper(tiny_dir, backend="native")
    rng = np.random.default_rng(11)
    system = rng.integers(3, 380, size=500).tolist()  # 31 full pages + 4 positions of page 31
    prompts = [system + rng.integers(3, 380, size=5 + i).tolist() for i in range(8)]
    handles = [model.submit(p, max_new_tokens=6, output_logits=True, salt="team") for p in prompts]
    other = model.submit(prompts[3], max_new_tokens=6, output_logits=True, salt="another-tenant")
    results = [h.result() for h in handles]
    assert results[0].stats.reused_tokens == 0
    assert [r.stats.reused_tokens for r in results[1:]] == [31 * PAGE] * 7
    assert [r.stats.prefilled_tokens for r in results[1:]] == [len(p) - 31 * PAGE for p in prompts[1:]]
    assert model.kv_stats()["prefix_inflight_hits"] == 7
    for p, r in zip(prompts, results, strict=True):
        same(r, alone(alone_model, p, 6))
    r = other.result()
    assert r.stats.reused_tokens == 0, "another salt shares nothing"
    same(r, alone(alone_model, prompts[3], 6))
    check_pool(model)


def test_followers_keep_the_pages_they_share_when_the_request_that_computed_them_is_cancelled(
    tiny_dir: Path, alone_model: Any
) -> None:
    """The first request computes the shared prefix and is cancelled right after the followers took its
    pages: they finish with what they get alone, nothing of the cancelled request is indexed, no page leaks."""
    model = stepper(tiny_dir, backend="native")
    rng = np.random.default_rng(12)
    system = rng.integers(3, 380, size=200).tolist()
    prompts = [system + rng.integers(3, 380, size=7).tolist() for _ in range(3)]
    stop = threading.Event()
    leader = model.submit(prompts[0], max_new_tokens=20, cancel=stop)
    followers = [model.submit(p, max_new_tokens=5, output_logits=True) for p in prompts[1:]]
    model.step()  # the leader prefills; the followers wait for it
    assert model.kv_stats()["waiting"] == 2
    model.step()  # the followers are admitted on its pages
    assert model.kv_stats()["prefix_inflight_hits"] == 2
    stop.set()
    with pytest.raises(Cancelled):
        leader.result()
    for p, h in zip(prompts[1:], followers, strict=True):
        r = h.result()
        assert r.stats.reused_tokens == 192
        same(r, alone(alone_model, p, 5))
    digest = leader.request.digest
    assert model.executor.kv.index.match(digest, [*prompts[0], 1]).length <= len(system), (
        "the cancelled request's own positions are never indexed"
    )
    check_pool(model)


def test_stateless_requests_share_prefixes_and_a_pin_survives_eviction(tiny_dir: Path) -> None:
    spec = onnxgen.load(str(tiny_dir), backend="native", paged=False).spec
    model = stepper(tiny_dir, backend="native", kv_bytes=8 * PAGE * per_token_bytes(spec))
    s = model.session()
    base = list(range(3, 60))  # 57 tokens
    r1 = s.generate(base, max_new_tokens=4)
    held = len(base) + len(r1.tokens) - 1
    for k in range(3):  # unrelated stateless requests fill the 8-page pool: unpinned pages are evicted
        model.generate([100 + k] * 60, max_new_tokens=2)
    r2 = s.generate(base + r1.tokens + [5], max_new_tokens=2)
    assert r2.stats.reused_tokens == held, "the session's pinned context was not evicted"
    check_pool(model)


# --- memory pressure ------------------------------------------------------------------------------------


def test_sampled_requests_batched_equal_alone(tiny_dir: Path, alone_model: Any) -> None:
    """Seeded sampling (temperature, top-k, top-p, min-p, penalties) in one batch: each request's tokens are
    those it gets alone, whatever its neighbours ask for."""
    model = stepper(tiny_dir, backend="native")
    rng = np.random.default_rng(9)
    settings_ = [
        dict(temperature=0.8, seed=1),
        dict(temperature=1.2, top_k=20, seed=2),
        dict(temperature=1.0, top_p=0.8, seed=3),
        dict(temperature=0.7, min_p=0.1, seed=4),
        dict(temperature=1.0, repetition_penalty=1.3, seed=5),
        dict(temperature=0.0),
    ]
    prompts = [rng.integers(3, 380, size=25).tolist() for _ in settings_]
    handles = [
        model.submit(p, max_new_tokens=20, output_logits=True, **kw)
        for p, kw in zip(prompts, settings_, strict=True)
    ]
    for p, kw, h in zip(prompts, settings_, handles, strict=True):
        ref = alone_model.generate(p, max_new_tokens=20, output_logits=True, reuse=False, **kw)
        same(h.result(), ref)
    check_pool(model)


def test_pool_exhaustion_makes_requests_wait_and_every_result_is_right(
    tiny_dir: Path, alone_model: Any
) -> None:
    spec = alone_model.spec
    # 12 pages = 192 tokens for 8 requests of 52-72 tokens each, all queued before the first step
    model = stepper(tiny_dir, backend="native", kv_bytes=12 * PAGE * per_token_bytes(spec), max_running=8)
    rng = np.random.default_rng(3)
    prompts = [
        rng.integers(3, spec.vocab_size - 1, size=int(rng.integers(40, 60))).tolist() for _ in range(8)
    ]
    handles = [model.submit(p, max_new_tokens=12, output_logits=True) for p in prompts]
    for p, h in zip(prompts, handles, strict=True):
        same(h.result(), alone(alone_model, p, 12))
    assert model.kv_stats()["preemptions"] > 0, "the pool was meant to run out while requests decode"
    check_pool(model)


def test_threads_are_batched_into_the_same_steps(tiny_dir: Path, alone_model: Any) -> None:
    engine, model = loaded(tiny_dir, backend="native")
    steps = {"n": 0, "batched": 0}
    original = engine.executor.run

    def counting(chunks: Any) -> Any:
        steps["n"] += 1
        steps["batched"] += len(chunks) > 1
        return original(chunks)

    engine.executor.run = counting
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 380, size=30).tolist() for _ in range(6)]
    out: list[Any] = [None] * 6
    barrier = threading.Barrier(6)

    def client(i: int) -> None:
        barrier.wait()
        out[i] = model.generate(prompts[i], max_new_tokens=24, output_logits=True)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for p, r in zip(prompts, out, strict=True):
        same(r, alone(alone_model, p, 24))
    assert steps["batched"] > 0, "concurrent callers never shared a step"
    assert steps["n"] < 6 * 24, f"{steps['n']} steps for 6 x 24 tokens: not batched"
    check_pool(engine)


def test_a_request_larger_than_the_pool_fails_clearly(tiny_dir: Path) -> None:
    spec = onnxgen.load(str(tiny_dir), backend="native", paged=False).spec
    model = stepper(tiny_dir, backend="native", kv_bytes=2 * PAGE * per_token_bytes(spec))
    with pytest.raises(onnxgen.OnnxgenError, match="KV pool holds 32 tokens"):
        model.generate(list(range(3, 60)), max_new_tokens=2)
    r = model.generate(list(range(3, 20)), max_new_tokens=2)  # the engine is fine afterwards
    assert r.stats.generated_tokens == 2
    check_pool(model)


@pytest.mark.parametrize("policy", ["fair", "fifo"])
def test_short_prompts_are_not_held_behind_a_long_prefill(
    tiny_dir: Path, alone_model: Any, policy: str
) -> None:
    """A 700-token prompt prefills within 64 tokens a step; three short prompts arriving a step later get their
    first tokens within two engine steps (`prefill_policy="fair"`; first come first served held them for the
    long prompt's prefill), the long prompt's first token comes within a few steps of its own 11, and every
    request gets what it gets alone."""
    model = stepper(tiny_dir, backend="native", max_batch_tokens=64, prefill_policy=policy)
    rng = np.random.default_rng(21)
    long = rng.integers(3, 380, size=700).tolist()
    shorts = [rng.integers(3, 380, size=9 + i).tolist() for i in range(3)]
    lead = model.submit(long, max_new_tokens=4, output_logits=True)
    model.step()
    after = [model.submit(p, max_new_tokens=4, output_logits=True) for p in shorts]
    first: dict[int, int] = {}
    step = 1
    while not all(t.done() for t in (lead, *after)):
        model.step()
        step += 1
        for i, t in enumerate((lead, *after)):
            if i not in first and t.request.output:
                first[i] = step - (0 if i == 0 else 1)
    waits = [first[i] for i in (1, 2, 3)]
    if policy == "fifo":
        assert min(waits) >= 10, waits
    else:
        assert max(waits) <= 2, waits
        assert first[0] <= 700 // 64 + 3, first[0]
    for p, t in zip((long, *shorts), (lead, *after), strict=True):
        same(t.result(), alone(alone_model, p, 4))
    check_pool(model)
