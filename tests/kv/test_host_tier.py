"""The host tier through the engine (`CacheConfig.host_kv_bytes`): a session offloaded to host memory continues
exactly as a retained one (fp32: identical tokens, logits within 1e-5) on both backends; pages the paged pool's
prefix index evicts come back from host memory instead of being recomputed; random turns, offloads and pool
pressure equal cold runs while the tier stays within its bound. On CUDA (marked `gpu`): the same through
pinned slabs and the copy stream."""

from __future__ import annotations

import numpy as np
import pytest

import onnxgen
from onnxgen.config import CacheConfig
from tests.conftest import native_available
from tests.harness import loaded

NATIVE = pytest.mark.skipif(not native_available(), reason="the native backend needs torch")
MODES = {"ort": {"backend": "ort"}, "native-paged": {"backend": "native"}}
GREEDY = {"temperature": 0, "output_logits": True}


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


def _modes() -> list:
    return [pytest.param(k, marks=NATIVE) if k.startswith("native") else k for k in MODES]


def _context(r) -> list[int]:
    return [*r.prompt_ids, *r.tokens]


def _kv_per_token(m) -> int:
    spec = m.spec
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_size * 4  # fp32


def offload_and_continue(tiny_dir, device: str, options: dict) -> None:
    """Turn 1, then turn 2 on a retained session (one model) and on a session offloaded to the host tier
    between the turns (another model): the same tokens, logits within 1e-5, the context reused from host
    memory (a paged pool's last partial page is recomputed: the tier holds full pages)."""
    kept_m = onnxgen.load(str(tiny_dir), device=device, **options)
    host_m = onnxgen.load(str(tiny_dir), device=device, host_kv_bytes=64 << 20, **options)
    try:
        vocab = kept_m.spec.vocab_size
        first = _ids(300, 1, vocab)
        kept, moved = kept_m.session(), host_m.session()
        r1 = kept.generate(first, max_new_tokens=6, **GREEDY)
        assert moved.generate(first, max_new_tokens=6, **GREEDY).tokens == r1.tokens
        held = moved.retained_tokens
        assert moved.offload() > 0 and moved.retained_tokens == 0
        stats = host_m.kv_stats()
        if host_m.paged:
            assert stats["pages_indexed"] == 0 and stats["host_pages"] == held // stats["page_size"], stats
        follow = [*_context(r1), *_ids(20, 2, vocab)]
        a = kept.generate(follow, max_new_tokens=6, **GREEDY)
        b = moved.generate(follow, max_new_tokens=6, **GREEDY)
        assert b.tokens == a.tokens
        np.testing.assert_allclose(np.asarray(b.logits), np.asarray(a.logits), rtol=0, atol=1e-5)
        stats = host_m.kv_stats()
        if host_m.paged:
            P = stats["page_size"]
            assert b.stats.reused_tokens == held // P * P and stats["host_pages_restored"] == held // P
        else:
            assert b.stats.reused_tokens == held and stats["unspills"] == 1
    finally:
        kept_m.close()
        host_m.close()


@pytest.mark.parametrize("mode", _modes())
def test_an_offloaded_session_continues_exactly_as_the_retained_one(tiny_dir, mode):
    offload_and_continue(tiny_dir, "cpu", MODES[mode])


@NATIVE
def test_pages_the_index_evicts_come_back_from_host_memory(tiny_dir):
    """Stateless requests (no session pins their pages) in a pool that holds about two of them: the earlier
    ones' pages are evicted into the host tier, and the same prompt continued later restores them (they count
    as cached) instead of recomputing; the output equals a cold run's."""
    probe = onnxgen.load(str(tiny_dir), backend="native")
    per_token = _kv_per_token(probe)
    probe.close()
    pool = 2 * 260 * per_token
    engine, m = loaded(tiny_dir, backend="native", kv_bytes=pool, host_kv_bytes=4 * 260 * per_token)
    try:
        vocab = m.spec.vocab_size
        prompts = [_ids(240, 10 + i, vocab) for i in range(4)]
        firsts = [m.generate(p, max_new_tokens=4, temperature=0) for p in prompts]
        stats = m.kv_stats()
        assert stats["host_pages_saved"] > 0 and stats["host_pages_bytes"] <= stats["host_pages_bound"]
        follow = [*_context(firsts[0]), *_ids(16, 99, vocab)]  # the oldest: its pages left the pool
        warm = m.generate(follow, max_new_tokens=4, temperature=0)
        P = stats["page_size"]
        assert warm.stats.reused_tokens == len(_context(firsts[0])) // P * P, warm.stats
        assert m.kv_stats()["prefix_restored_tokens"] >= 240 // P * P
        engine.executor.index.check_integrity()
        cold = onnxgen.load(str(tiny_dir), backend="native")
        try:
            assert warm.tokens == cold.generate(follow, max_new_tokens=4, temperature=0, reuse=False).tokens
        finally:
            cold.close()
    finally:
        m.close()


@NATIVE
@pytest.mark.parametrize("seed", [0, 1])
def test_random_turns_offloads_and_pressure_equal_cold_runs(tiny_dir, seed):
    """Five sessions, two kept pinned, a pool of 320 tokens and a host tier of 400: random
    turns, offloads and clears; wherever each context was (pinned, indexed, in host memory, dropped), every turn
    equals a cold run of the same prompt, the tier never exceeds its bound, the index stays consistent."""
    rng = np.random.default_rng(seed)
    cold = onnxgen.load(str(tiny_dir), backend="native")
    per_token = _kv_per_token(cold)
    bound = 2 * 200 * per_token
    engine, m = loaded(
        tiny_dir, backend="native", max_sessions=2, kv_bytes=320 * per_token, host_kv_bytes=bound
    )
    try:
        vocab = m.spec.vocab_size
        sessions = [m.session() for _ in range(5)]
        contexts: list[list[int]] = [[] for _ in sessions]
        for step in range(30):
            i = int(rng.integers(len(sessions)))
            if len(contexts[i]) > 150 or rng.random() < 0.1:
                sessions[i].clear()
                contexts[i] = []
                continue
            if rng.random() < 0.25:
                sessions[i].offload()
                continue
            prompt = [*contexts[i], *_ids(int(rng.integers(20, 60)), 1000 * seed + step, vocab)]
            warm = sessions[i].generate(prompt, max_new_tokens=3, temperature=0)
            assert warm.tokens == cold.generate(prompt, max_new_tokens=3, temperature=0, reuse=False).tokens
            contexts[i] = _context(warm)
            stats = m.kv_stats()
            assert stats["host_pages_bytes"] <= bound, stats
            engine.executor.index.check_integrity()
            engine.executor.kv.allocator.check_integrity()
        assert m.kv_stats()["host_pages_restored"] > 0
    finally:
        m.close()
        cold.close()


class SlowCopy:
    """Stands in for a CUDA event: the copy reads as done only after `queries` polls (or a wait)."""

    def __init__(self, queries: int) -> None:
        self.left = queries
        self.waited = False

    def query(self) -> bool:
        self.left -= 1
        return self.left < 0

    def synchronize(self) -> None:
        self.waited = True


@NATIVE
@pytest.mark.parametrize("busy", [True, False])
def test_a_restore_in_flight_is_waited_for_by_its_request_alone(tiny_dir, monkeypatch, busy):
    """The copy back from host memory as on CUDA (an event not done at once): the request that needs it waits
    in the queue while another request keeps stepping, and is admitted once the copy is done; with nothing
    else running, the engine waits for the copy instead. Either way the turn equals a cold run."""
    from tests.harness import stepper

    st = stepper(tiny_dir, backend="native", host_kv_bytes=16 << 20)
    vocab = st.engine.spec.vocab_size
    s = st.session()
    first = s.generate(_ids(200, 3, vocab), max_new_tokens=3, temperature=0)
    s.offload()
    tier = st.engine.executor.tier
    copies: list[SlowCopy] = []
    load = tier.load

    def slow_load(keys, pages):
        assert load(keys, pages) is None  # the CPU copied at once; the event says otherwise for a while
        copies.append(SlowCopy(3))
        return copies[-1]

    monkeypatch.setattr(tier, "load", slow_load)
    other = st.submit(_ids(30, 4, vocab), max_new_tokens=12, temperature=0, reuse=False) if busy else None
    if busy:
        st.step()  # the other request runs
    follow = [*_context(first), *_ids(10, 5, vocab)]
    handle = s.session.submit(follow, max_new_tokens=3, temperature=0)
    waiting = st.engine.scheduler
    if busy:
        steps = 0
        while steps < 10:
            st.step()
            steps += 1
            mine = [r for r in waiting.waiting if r.owner is s.session]
            if copies[-1].left >= 0:  # the copy is not done: the request waits, the other one steps
                assert mine and mine[0].kv is None, "admitted before its pages were back"
            else:
                assert not mine, "still waiting once its pages are back"
                break
        assert steps == 4 and not other.done() and not copies[-1].waited
    result = st.wait(handle)
    assert len(copies) == 1 and copies[0].waited is not busy
    assert result.stats.reused_tokens == len(_context(first)) - 1 - (len(_context(first)) - 1) % 16
    cold = onnxgen.load(str(tiny_dir), backend="native")
    try:
        assert result.tokens == cold.generate(follow, max_new_tokens=3, temperature=0, reuse=False).tokens
    finally:
        cold.close()
    if other is not None:
        other.result()
    st.engine.close()


@NATIVE
def test_metrics_report_the_pool_host_tier(tiny_dir):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from onnxgen.serve.app import RunningServer, ServerConfig, create_app

    m = onnxgen.load(str(tiny_dir), backend="native", host_kv_bytes=8 << 20)
    s = m.session()
    first = s.generate(_ids(100, 8, m.spec.vocab_size), max_new_tokens=2, temperature=0)
    s.offload()
    s.generate([*_context(first), 5, 6], max_new_tokens=2, temperature=0)
    with RunningServer(create_app(m, ServerConfig())) as srv:
        text = httpx.get(srv.url + "/metrics").text
    lines = dict(ln.rsplit(" ", 1) for ln in text.splitlines() if ln.startswith("onnxgen_host_pages"))
    stats = m.kv_stats()
    assert float(lines["onnxgen_host_pages"]) == stats["host_pages"] == 100 // 16
    assert float(lines["onnxgen_host_pages_restored"]) == stats["host_pages_restored"] == 100 // 16
    m.close()


@NATIVE
def test_the_host_tier_is_there_only_when_asked_for(tiny_dir):
    assert CacheConfig().host_bytes_for(True) == CacheConfig().host_bytes_for(False) == 0
    assert CacheConfig(host_kv_bytes=123).host_bytes_for(True) == 123
    plain, tiered = (
        onnxgen.load(str(tiny_dir), backend="native", **o) for o in ({}, {"host_kv_bytes": 1 << 20})
    )
    try:
        assert "host_pages" not in plain.kv_stats() and plain.session().offload() == 0
        assert tiered.kv_stats()["host_pages_bound"] == 1 << 20
    finally:
        plain.close()
        tiered.close()


# --- CUDA: pinned slabs, the copy stream ---------------------------------------------------------------


@pytest.mark.gpu
def test_on_cuda_pages_go_through_pinned_slabs_and_the_copy_stream():
    import torch

    from onnxgen.kv.storage import PageStorage
    from onnxgen.kv.tiers import HostPages

    s = PageStorage(2, 64, 16, 2, 8, torch.bfloat16, "cuda")
    s.data.normal_()
    want = s.data[:, :, :40].clone()
    tier = HostPages(s, 48 * s.data[:, :, 0].numel() * 2)
    keys = [bytes([i]) * 16 for i in range(40)]
    tier.save(keys, list(range(40)))
    assert tier._slabs[0].is_pinned()
    s.data[:, :, :40].zero_()  # the compute stream reuses the pages: after the copies (it waits for them)
    tier.backup(keys[:8], list(range(8)))  # held already: nothing copied
    assert tier.counters.backed_up == 0
    event = tier.load(keys, list(range(63, 23, -1)))
    assert event is not None
    event.synchronize()
    for i in range(40):
        assert torch.equal(s.data[:, :, 63 - i], want[:, :, i]), i


@pytest.mark.gpu
def test_on_cuda_an_offloaded_session_continues_exactly_as_the_retained_one(tiny_dir):
    offload_and_continue(tiny_dir, "cuda", {"backend": "native"})
