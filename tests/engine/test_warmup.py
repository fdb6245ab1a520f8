"""The load-time warm-up (`engine.warmup`): it runs its burst through the engine's own path, leaves no page,
cache entry or counter behind, and what a warmed model generates equals what a cold one does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import onnxgen
from onnxgen.config import ModelConfig
from onnxgen.engine.warmup import burst_sizes, warm_up
from onnxgen.errors import InvalidRequest
from tests.conftest import native_available

pytestmark = pytest.mark.skipif(not native_available(), reason="native backend not importable")


def test_burst_sizes_reach_max_running_and_no_further() -> None:
    assert burst_sizes(1) == [1]
    assert burst_sizes(8) == [2, 4, 8]
    assert burst_sizes(20) == [2, 4, 8, 16, 20]
    assert burst_sizes(64) == [2, 4, 8, 16, 32, 64]


def test_warmup_is_on_by_default_on_cuda_only() -> None:
    assert ModelConfig(device="cuda").warmup_for() is True
    assert ModelConfig(device="cpu").warmup_for() is False
    assert ModelConfig(device="cuda", warmup=False).warmup_for() is False
    with pytest.raises(InvalidRequest, match="warmup"):
        ModelConfig(warmup="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("paged", [True, False])
def test_warmed_model_leaves_nothing_behind_and_generates_as_a_cold_one(tiny_dir: Path, paged: bool) -> None:
    opts: dict[str, Any] = {"backend": "native", "paged": paged, "max_running": 4, "kv_floor": 16}
    cold = onnxgen.load(str(tiny_dir), **opts)
    warm = onnxgen.load(str(tiny_dir), warmup=True, **opts)
    stats = warm.kv_stats()
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["retained_kv_bytes"] == 0
    if paged:
        assert stats["pages_used"] == 0 and stats["prefix_lookups"] == 0 and stats["pages_indexed"] == 0
    else:
        assert stats["stateless_contexts"] == 0
    prompt = list(range(5, 45))
    a = cold.generate(prompt, max_new_tokens=12, output_logits=True)
    b = warm.generate(prompt, max_new_tokens=12, output_logits=True)
    assert a.tokens == b.tokens and a.tokens
    np.testing.assert_allclose(b.logits, a.logits, rtol=0, atol=1e-5)
    assert b.stats.reused_tokens == a.stats.reused_tokens == 0  # nothing of the warm-up was reused


def test_warm_up_report_counts_its_requests(tiny_dir: Path) -> None:
    model = onnxgen.load(str(tiny_dir), backend="native", paged=True, max_running=4)
    report = warm_up(model, longest=24)
    assert report.requests == 2 + sum(burst_sizes(4))
    assert report.tokens > report.requests  # every request generated, the drafting one more than one token
    assert report.seconds > 0
    assert model.kv_stats()["pages_used"] == 0
