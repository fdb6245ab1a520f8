"""Concurrent sessions of one engine give exactly the results of the same requests run one after another
(the `Engine` contract: different sessions may run concurrently), on both backends; on CUDA with graphs
on, and a failed graph capture leaves the decoder and the process usable."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import onnxgen
from tests.harness import loaded

THREADS, TURNS, NEW = 4, 3, 8


def _turns(seed: int, vocab: int) -> list[list[int]]:
    """Each turn's new tokens for one conversation (a different conversation per seed)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab - 1, size=int(rng.integers(20, 60))).tolist() for _ in range(TURNS)]


def _conversation(session: Any, turns: list[list[int]], logits: bool = True, **kw: Any) -> list[Any]:
    """Run a conversation: each turn's prompt is the last prompt + its reply + the turn's new tokens."""
    prompt: list[int] = []
    results = []
    for new in turns:
        prompt = prompt + (results[-1].tokens if results else []) + new
        results.append(
            session.generate(prompt, max_new_tokens=NEW, temperature=0, output_logits=logits, **kw)
        )
    return results


def _check_concurrent_equals_serial(model: Any, logits: bool = True, **kw: Any) -> None:
    """`logits`: compare each turn's logits too (kept logits need the host at every step: no decode runs);
    `kw`: more `generate` arguments."""
    vocab = model.spec.vocab_size
    plans = [_turns(100 + i, vocab) for i in range(THREADS)]
    # each conversation under a salt of its own: with paged KV, sessions under one salt share prefix pages,
    # and the serial run's pages would be found by the concurrent run
    serial = [_conversation(model.session(salt=f"serial-{i}"), p, logits, **kw) for i, p in enumerate(plans)]
    sessions = [model.session(salt=f"concurrent-{i}") for i in range(THREADS)]
    barrier = threading.Barrier(THREADS)
    out: list[Any] = [None] * THREADS
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            barrier.wait()
            out[i] = _conversation(sessions[i], plans[i], logits, **kw)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    for i in range(THREADS):
        for turn, (a, b) in enumerate(zip(out[i], serial[i], strict=True)):
            assert a.tokens == b.tokens, f"thread {i} turn {turn}: tokens differ from the serial run"
            assert a.stats.reused_tokens == b.stats.reused_tokens
            if turn:
                assert a.stats.reused_tokens > 0, "later turns reuse their session's cache"
            if logits:
                d = np.linalg.norm(a.logits - b.logits) / np.linalg.norm(b.logits)
                assert d <= 1e-5, f"thread {i} turn {turn}: logits differ by {d:.2e}"


@pytest.mark.parametrize("backend", ["ort", "native"])
def test_four_threads_on_four_sessions_equal_serial_runs(backend: str, tiny_dir: Path) -> None:
    model = onnxgen.load(str(tiny_dir), backend=backend, device="cpu", threads=1)
    _check_concurrent_equals_serial(model)


def test_four_threads_with_decode_runs_equal_serial_runs(tiny_dir: Path) -> None:
    """The paged engine with runs of decode steps, each first run launched behind its prompts' step (as on
    CUDA, `launch_first`), serving four threads' conversations: the serial runs' tokens and reuse."""
    engine, model = loaded(
        tiny_dir, backend="native", device="cpu", threads=1, paged=True, decode_steps=8, launch_first=True
    )
    launched = []
    launch_first = engine.pipeline.launch_first
    engine.pipeline.launch_first = lambda *a: launched.append(a) or launch_first(*a)
    _check_concurrent_equals_serial(
        model, logits=False, speculative=False
    )  # no drafts: first runs launched early
    assert launched


# --- CUDA -----------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_four_threads_with_graphs_equal_serial_runs(tiny_dir: Path) -> None:
    engine, model = loaded(tiny_dir, backend="native", device="cuda", kv_floor=16, paged=False)
    _check_concurrent_equals_serial(model)
    decoder = engine.pool.acquire()
    assert decoder.info["cuda_graphs"], "graphs stayed on through the concurrent run"


@pytest.mark.gpu
def test_cuda_paged_four_threads_with_graphs_equal_serial_runs(tiny_dir: Path) -> None:
    model = onnxgen.load(str(tiny_dir), backend="native", device="cuda")
    assert model.paged
    _check_concurrent_equals_serial(model)
    assert model.kv_stats()["cuda_graphs"], "graphs stayed on through the concurrent run"


@pytest.mark.gpu
def test_cuda_failed_capture_falls_back_to_eager_and_leaves_the_process_usable(tiny_dir: Path) -> None:
    import torch

    from onnxgen.backends.native.decoder import NativeDecoder
    from onnxgen.package.spec import load_spec

    spec = load_spec(tiny_dir)
    cpu = NativeDecoder(spec)
    broken = NativeDecoder(spec, "cuda", kv_floor=16)
    step = broken.program.steps[len(broken.program.steps) // 2]
    original = step.fn

    def sync_while_capturing(ctx: Any, *args: Any) -> Any:  # a foreign synchronising call mid-capture
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()
        return original(ctx, *args)

    step.fn = sync_while_capturing  # NOTE: the program is shared by every decoder of the package
    try:
        toks = list(range(5, 45))
        a, b = cpu.forward(toks, 0), broken.forward(toks, 0)
        for t in range(8):  # the first decode step tries to capture, fails, and runs eagerly
            a, b = cpu.forward([t + 3], cpu.kv_len()), broken.forward([t + 3], broken.kv_len())
            assert float((b.cpu() - a).norm() / a.norm()) <= 1e-4
        assert not broken.info["cuda_graphs"]
    finally:
        step.fn = original
    # the process is fine: random ops on the default generator, and a new decoder captures again
    torch.randn(16, device="cuda").sum().item()
    torch.multinomial(torch.ones(8, device="cuda"), 2).cpu()
    fresh = NativeDecoder(spec, "cuda", kv_floor=16)
    fresh.forward(toks, 0)
    for t in range(4):
        fresh.forward([t + 3], fresh.kv_len())
    assert fresh.info["cuda_graphs"] and fresh.info["graphs"]


def test_a_cpu_load_builds_its_engine_on_a_thread_that_ends_with_it(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's torch work at load (lowering, the KV pool) runs on a passing thread, so that the loop thread
    is the only thread left with an OpenMP pool (`engine/loop.py`); the model works, and a load error raised
    there reaches the caller as itself."""
    import onnxgen.engine.engine as engine_module
    from onnxgen.errors import BackendUnavailable

    seen: list[threading.Thread] = []
    real = engine_module.build_executor

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "build_executor", spy)
    model = onnxgen.load(str(tiny_dir), device="cpu", backend="native")
    try:
        assert len(seen) == 1 and seen[0] is not threading.current_thread() and not seen[0].is_alive()
        assert len(model.generate([5, 6, 7], max_new_tokens=3, temperature=0).tokens) == 3
    finally:
        model.close()
    with pytest.raises(BackendUnavailable):
        onnxgen.load(str(tiny_dir), device="cpu", backend="ort", paged=True)
    assert len(seen) == 2 and seen[1] is not threading.current_thread()
