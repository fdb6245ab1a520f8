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
