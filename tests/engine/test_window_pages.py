"""Pages that fall out of every layer's sliding window on the paged pool (native backend, CPU), for a model
whose every layer attends within a window (Mistral's layout: here a synthetic package with a window of 20 on
both layers).

A request that no session keeps gives its pages back as they leave the window: it holds about a window of KV
however long it runs, and computes exactly what it computes alone on a contiguous cache that keeps
everything. What it leaves in the index is only what is still there, so a later request reuses nothing that
is gone; a session's requests keep every page, so the next turn reuses its whole context.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import onnxgen
from onnxgen.kv.manager import HOLE
from tests.conftest import native_available
from tests.harness import Ticket, stepper

pytestmark = pytest.mark.skipif(not native_available(), reason="native backend not importable")

WINDOW, PAGE = 20, 16


@pytest.fixture(scope="module")
def windowed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from onnxgen.convert.synthetic import SyntheticConfig, write_package

    cfg = SyntheticConfig(num_layers=2, context_length=1024, local_window_size=WINDOW)
    return write_package(tmp_path_factory.mktemp("windowed") / "pkg", cfg)


@pytest.fixture(scope="module")
def alone_model(windowed_dir: Path) -> Any:
    """The reference: a contiguous cache that keeps every position, computed from scratch."""
    return onnxgen.load(str(windowed_dir), backend="native", paged=False, kv_floor=16)


def same(got: Any, ref: Any) -> None:
    assert got.tokens == ref.tokens
    d = np.linalg.norm(got.logits - ref.logits, axis=-1) / np.linalg.norm(ref.logits, axis=-1)
    assert float(d.max()) <= 1e-5


def held(req: Any) -> int:
    return sum(p != HOLE for p in req.kv.pages)


def check_pool(model: Any) -> None:
    kv = model.executor.kv
    kv.allocator.check_integrity()
    kv.index.check_integrity()
    assert model.kv_stats()["pages_used"] == len(kv.index.pages()), "a page leaked"
    for page in kv.index.pages():
        assert page != HOLE


def test_the_runner_reports_the_window_every_layer_attends_within(windowed_dir: Path, tiny_dir: Path) -> None:
    from onnxgen.backends.native.runner import NativeRunner
    from onnxgen.package import load_spec

    assert NativeRunner(load_spec(windowed_dir), kv_bytes=1 << 20).kv_window == WINDOW
    assert NativeRunner(load_spec(tiny_dir), kv_bytes=1 << 20).kv_window == 0


def test_long_requests_hold_about_a_window_and_equal_a_cache_that_keeps_everything(
    windowed_dir: Path, alone_model: Any
) -> None:
    """Three one-shot requests at once, prefilled in chunks of 24 that cross the window's edge (a budget of 48
    tokens a step), then decoding far past it: each holds at most the pages its next chunk's window and the
    chunk span, and each equals its run alone."""
    model = stepper(windowed_dir, backend="native", max_batch_tokens=48, chunk_size=24)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 380, size=n).tolist() for n in (150, 61, 97)]
    handles = [model.submit(p, max_new_tokens=40, output_logits=True) for p in prompts]
    most = 0
    while not all(h.done() for h in handles):
        model.step()
        for r in model.scheduler.running:
            most = max(most, held(r))
    assert most <= -(-(WINDOW - 1 + 24) // PAGE) + 1, most
    assert model.kv_stats()["pages_trimmed"] >= sum((len(p) + 40 - WINDOW) // PAGE - 1 for p in prompts)
    for p, h in zip(prompts, handles, strict=True):
        same(h.result(), alone_model.generate(p, max_new_tokens=40, output_logits=True, reuse=False))
    check_pool(model)


def test_what_is_gone_is_never_reused(windowed_dir: Path, alone_model: Any) -> None:
    """A shared prefix committed by a session stays (the index holds it) while a one-shot request under it trims
    its own pages; the one-shot request's context is then indexed only up to its first hole, so the same
    prompt again reuses the prefix alone, and equals its run alone."""
    model = stepper(windowed_dir, backend="native")
    rng = np.random.default_rng(5)
    system = rng.integers(3, 380, size=40).tolist()  # two full pages and 8 positions
    s = model.session()
    s.generate(system, max_new_tokens=1, temperature=0)
    prompt = system + rng.integers(3, 380, size=90).tolist()
    first = model.generate(prompt, max_new_tokens=12, output_logits=True, temperature=0)
    assert first.stats.reused_tokens == 2 * PAGE + 8  # the full pages, and the copied partial one
    again = model.generate(prompt, max_new_tokens=12, output_logits=True, temperature=0)
    assert again.stats.reused_tokens == 2 * PAGE + 8, "only pages that are still there are reused"
    ref = alone_model.generate(prompt, max_new_tokens=12, output_logits=True, reuse=False)
    same(first, ref)
    same(again, ref)
    assert model.kv_stats()["pages_trimmed"] > 0
    check_pool(model)


def test_a_sessions_context_keeps_every_page_and_is_reused(windowed_dir: Path, alone_model: Any) -> None:
    model = stepper(windowed_dir, backend="native")
    rng = np.random.default_rng(6)
    s = model.session()
    turn1 = rng.integers(3, 380, size=100).tolist()
    r1 = s.generate(turn1, max_new_tokens=10, temperature=0)
    turn2 = turn1 + r1.tokens + rng.integers(3, 380, size=30).tolist()
    r2 = s.generate(turn2, max_new_tokens=10, output_logits=True, temperature=0)
    assert r2.stats.reused_tokens >= len(turn1) + 9
    assert model.kv_stats()["pages_trimmed"] == 0
    same(r2, alone_model.generate(turn2, max_new_tokens=10, output_logits=True, reuse=False))
    check_pool(model)


ARRIVALS = st.lists(
    st.fixed_dictionaries(
        {
            "at": st.integers(0, 5),  # the step at which it arrives
            "cut": st.integers(0, 60),  # how much of the shared prefix it starts with
            "tail": st.integers(1, 60),  # its own tokens after it
            "n": st.integers(1, 30),  # tokens to generate
            "cancel": st.one_of(st.none(), st.integers(0, 6)),  # cancelled this many steps after arriving
            "session": st.booleans(),  # kept by a session (never trimmed)
        }
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arrivals=ARRIVALS)
def test_trimmed_requests_under_random_arrivals_cancels_and_preemption_equal_each_alone(
    windowed_dir: Path, alone_model: Any, arrivals: list[dict]
) -> None:
    """Requests arriving at random steps over a shared prefix, some in sessions (short ones: they keep every
    page), some cancelled, in a pool of 8 pages (128 positions, less than a long request's context: only its
    trimming lets it run; requests wait and are preempted): each finished one equals its run alone, and no
    page leaks or is indexed while gone."""
    import threading

    from onnxgen.errors import Cancelled

    per_token = 2 * 2 * alone_model.spec.num_kv_heads * alone_model.spec.head_size * 4
    model = stepper(windowed_dir, backend="native", kv_bytes=8 * PAGE * per_token, max_batch_tokens=32)
    rng = np.random.default_rng(len(arrivals))
    base = rng.integers(3, 380, size=60).tolist()
    pending = []
    todo = sorted(arrivals, key=lambda a: a["at"])
    step = 0
    while todo or any(not h.done() for _, _, h, _ in pending):
        while todo and todo[0]["at"] <= step:
            a = todo.pop(0)
            prompt = base[: a["cut"]] + rng.integers(3, 380, size=a["tail"]).tolist()
            if a["session"]:
                prompt, a["n"] = prompt[:40], min(a["n"], 10)
            ev = threading.Event()
            if a["session"]:
                s = model.session()
                h = Ticket(model, s.submit(prompt, max_new_tokens=a["n"], output_logits=True, cancel=ev))
            else:
                h = model.submit(prompt, max_new_tokens=a["n"], output_logits=True, cancel=ev)
            pending.append((a, prompt, h, ev))
        for a, _, h, ev in pending:
            if a["cancel"] is not None and step >= a["at"] + a["cancel"] and not h.done():
                ev.set()
        model.step()
        step += 1
        assert step < 5_000, "the engine made no progress"
    for a, prompt, h, ev in pending:
        if ev.is_set() and h.error is not None:
            with pytest.raises(Cancelled):
                h.result()
            continue
        same(h.result(), alone_model.generate(prompt, max_new_tokens=a["n"], output_logits=True, reuse=False))
    kv = model.executor.kv
    kv.allocator.check_integrity()
    kv.index.check_integrity()
    assert HOLE not in kv.index.pages()
