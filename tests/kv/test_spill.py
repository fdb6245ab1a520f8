"""The disk tier (`CacheConfig.kv_dir`, `engine/spill.py`): sessions pushed out by `max_sessions` spill their
KV to session files and resume from them at their next request; the files stay within `kv_dir_bytes`; every
turn equals a cold run whatever was spilled, resumed or dropped."""

from __future__ import annotations

import numpy as np
import pytest

import onnxgen
from tests.conftest import native_available
from tests.harness import loaded

MODES = {"ort": {"backend": "ort"}, "native-paged": {"backend": "native"}}
NATIVE = pytest.mark.skipif(not native_available(), reason="the native backend needs torch")


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


def _modes() -> list:
    return [pytest.param(k, marks=NATIVE) if k.startswith("native") else k for k in MODES]


@pytest.mark.parametrize("mode", _modes())
def test_sessions_pushed_out_resume_from_their_files(tiny_dir, tmp_path, mode):
    kv_dir = tmp_path / "spill"
    engine, m = loaded(tiny_dir, device="cpu", max_sessions=2, kv_dir=str(kv_dir), **MODES[mode])
    try:
        vocab = m.spec.vocab_size
        sessions = [m.session() for _ in range(5)]
        contexts = []
        for i, s in enumerate(sessions):
            r = s.generate(_ids(200 + 10 * i, i, vocab), max_new_tokens=4, temperature=0)
            contexts.append([*r.prompt_ids, *r.tokens])
        for i, s in enumerate(sessions):  # round robin: every session but the last two was pushed out
            held = len(contexts[i]) - 1
            prompt = [*contexts[i], *_ids(12, 100 + i, vocab)]
            warm = s.generate(prompt, max_new_tokens=4, temperature=0)
            cold = m.generate(prompt, max_new_tokens=4, temperature=0, reuse=False)
            assert warm.tokens == cold.tokens, i
            assert warm.stats.reused_tokens == held, (i, warm.stats)
        engine.registry.spill.wait()  # the files of the sessions the last turns pushed out
        stats = m.kv_stats()
        assert stats["spills"] >= 3 and stats["unspills"] >= 3, stats
        on_disk = sorted(kv_dir.glob("*.onnxgen"))
        assert len(on_disk) == stats["spilled_sessions"] <= 3  # resumed files are deleted
        assert sum(p.stat().st_size for p in on_disk) == stats["spilled_bytes"]
    finally:
        m.close()
    assert list(kv_dir.glob("*")) == []  # closing the model deletes the tier's files


def test_the_tier_stays_within_its_bound_and_dropped_sessions_recompute(tiny_dir, tmp_path):
    kv_dir = tmp_path / "spill"
    probe = onnxgen.load(str(tiny_dir), device="cpu", backend="ort")
    s0 = probe.session()
    s0.generate(_ids(200, 0, probe.spec.vocab_size), max_new_tokens=4, temperature=0)
    one = s0.save(tmp_path / "one.onnxgen")  # about one session's file
    probe.close()
    bound = int(one * 1.5)  # room for one file, not two
    engine, m = loaded(
        tiny_dir, device="cpu", backend="ort", max_sessions=1, kv_dir=str(kv_dir), kv_dir_bytes=bound
    )
    try:
        vocab = m.spec.vocab_size
        sessions, contexts = [m.session() for _ in range(4)], []
        for i, s in enumerate(sessions):
            r = s.generate(_ids(200, i, vocab), max_new_tokens=4, temperature=0)
            contexts.append([*r.prompt_ids, *r.tokens])
            engine.registry.spill.wait()
            stats = m.kv_stats()
            assert stats["spilled_bytes"] <= bound, stats
        for i, s in enumerate(sessions):
            prompt = [*contexts[i], *_ids(8, 50 + i, vocab)]
            warm = s.generate(prompt, max_new_tokens=4, temperature=0)
            assert warm.tokens == m.generate(prompt, max_new_tokens=4, temperature=0, reuse=False).tokens
            assert m.kv_stats()["spilled_bytes"] <= bound
        engine.registry.spill.wait()
        assert m.kv_stats()["spills_dropped"] >= 1
        assert sum(p.stat().st_size for p in kv_dir.glob("*.onnxgen")) <= bound
    finally:
        m.close()


def test_kv_dir_options_are_checked():
    from onnxgen.config import Config
    from onnxgen.errors import InvalidRequest

    with pytest.raises(InvalidRequest):
        Config().replace(kv_dir_bytes=0)
    with pytest.raises(InvalidRequest):
        Config().replace(kv_dir=3)


def test_metrics_report_the_disk_tier(tiny_dir, tmp_path):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from onnxgen.serve.app import RunningServer, ServerConfig, create_app

    engine, m = loaded(tiny_dir, device="cpu", backend="ort", max_sessions=1, kv_dir=str(tmp_path / "spill"))
    vocab = m.spec.vocab_size
    for i in range(3):
        m.session().generate(_ids(60, i, vocab), max_new_tokens=2, temperature=0)
    engine.registry.spill.wait()  # two sessions pushed out: their files are written on the spill thread
    assert m.kv_stats()["spills"] == 2
    with RunningServer(create_app(m, ServerConfig())) as srv:
        text = httpx.get(srv.url + "/metrics").text
    lines = dict(ln.rsplit(" ", 1) for ln in text.splitlines() if ln.startswith("onnxgen_spill"))
    assert float(lines["onnxgen_spills"]) == m.kv_stats()["spills"] >= 1
    assert float(lines["onnxgen_spilled_bytes"]) == m.kv_stats()["spilled_bytes"] > 0
    m.close()


# --- the session-level host tier of the decoder-per-request executors (a paged pool's own tier of pages:
# tests/kv/test_host_tier.py); off unless host_kv_bytes is set ---------------------------------------------


def _session_bytes(tiny_dir, n: int) -> int:
    """The host bytes of one spilled session of `n` fed tokens (K and V, every layer, fp32)."""
    spec = onnxgen.load(str(tiny_dir), device="cpu", backend="ort").spec
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_size * 4 * n


def test_sessions_resume_from_host_memory_and_overflow_to_disk(tiny_dir, tmp_path):
    """Host tier sized for about two sessions, disk behind it: every session resumes with its whole context
    (from host memory or its file), the host tier never holds more than its bound."""
    one = _session_bytes(tiny_dir, 203)
    bound = int(one * 2.5)
    kv_dir = tmp_path / "spill"
    engine, m = loaded(
        tiny_dir, device="cpu", max_sessions=1, host_kv_bytes=bound, kv_dir=str(kv_dir), backend="ort"
    )
    try:
        vocab = m.spec.vocab_size
        sessions, contexts = [m.session() for _ in range(5)], []
        for i, s in enumerate(sessions):
            r = s.generate(_ids(200, 20 + i, vocab), max_new_tokens=4, temperature=0)
            contexts.append([*r.prompt_ids, *r.tokens])
            engine.registry.spill.wait()
            assert m.kv_stats()["host_bytes"] <= bound
        stats = m.kv_stats()
        assert stats["host_sessions"] == 2 and stats["spilled_sessions"] == 2, stats  # 4 out: 2 + 2
        for i, s in enumerate(sessions):
            prompt = [*contexts[i], *_ids(10, 60 + i, vocab)]
            warm = s.generate(prompt, max_new_tokens=4, temperature=0)
            assert warm.stats.reused_tokens == len(contexts[i]) - 1, (i, warm.stats)
            assert warm.tokens == m.generate(prompt, max_new_tokens=4, temperature=0, reuse=False).tokens
            engine.registry.spill.wait()
            assert m.kv_stats()["host_bytes"] <= bound
        assert m.kv_stats()["unspills"] >= 4
    finally:
        m.close()
    assert list(kv_dir.glob("*")) == []


def test_without_a_disk_the_host_tier_drops_its_oldest_and_they_recompute(tiny_dir):
    bound = int(_session_bytes(tiny_dir, 103) * 1.5)  # one session's KV fits, two do not
    engine, m = loaded(tiny_dir, device="cpu", backend="ort", max_sessions=1, host_kv_bytes=bound)
    try:
        vocab = m.spec.vocab_size
        sessions, contexts = [m.session() for _ in range(3)], []
        for i, s in enumerate(sessions):
            r = s.generate(_ids(100, 40 + i, vocab), max_new_tokens=4, temperature=0)
            contexts.append([*r.prompt_ids, *r.tokens])
        engine.registry.spill.wait()
        stats = m.kv_stats()
        assert stats["host_sessions"] == 1 and stats["spills_dropped"] == 1 and stats["host_bytes"] <= bound
        reused = {}
        for i in (1, 0, 2):  # 1 waits in host memory, 0 was dropped for it; 2 is the one kept in memory
            prompt = [*contexts[i], *_ids(6, 80 + i, vocab)]
            warm = sessions[i].generate(prompt, max_new_tokens=4, temperature=0)
            assert warm.tokens == m.generate(prompt, max_new_tokens=4, temperature=0, reuse=False).tokens
            reused[i] = warm.stats.reused_tokens
        assert reused[1] == len(contexts[1]) - 1 and reused[0] == 0, reused
    finally:
        m.close()


@pytest.mark.parametrize("seed", [0, 1])
def test_random_turns_across_the_tiers_equal_cold_runs(tiny_dir, tmp_path, seed):
    """Random turns over six sessions with one kept in memory, a host tier for one or two and a small disk:
    wherever each context was (kept, host, disk, dropped), every turn equals a cold run."""
    rng = np.random.default_rng(seed)
    one = _session_bytes(tiny_dir, 80)
    engine, m = loaded(
        tiny_dir,
        device="cpu",
        backend="ort",
        max_sessions=1,
        host_kv_bytes=int(one * 1.7),
        kv_dir=str(tmp_path / "spill"),
        kv_dir_bytes=int(one * 2.5),
    )
    try:
        vocab = m.spec.vocab_size
        sessions = [m.session() for _ in range(6)]
        contexts: list[list[int]] = [[] for _ in sessions]
        for step in range(24):
            i = int(rng.integers(len(sessions)))
            if rng.random() < 0.15:
                sessions[i].clear()
                contexts[i] = []
                continue
            prompt = [*contexts[i], *_ids(int(rng.integers(20, 60)), 1000 * seed + step, vocab)]
            warm = sessions[i].generate(prompt, max_new_tokens=3, temperature=0)
            assert warm.tokens == m.generate(prompt, max_new_tokens=3, temperature=0, reuse=False).tokens, (
                step
            )
            contexts[i] = [*warm.prompt_ids, *warm.tokens]
            engine.registry.spill.wait()
            stats = m.kv_stats()
            assert stats["host_bytes"] <= int(one * 1.7) and stats["spilled_bytes"] <= int(one * 2.5)
        assert m.kv_stats()["unspills"] > 0
    finally:
        m.close()
