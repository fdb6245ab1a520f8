"""Tensor parallelism (`backends/native/tp`) on the CPU: the sharding pass against the unsharded program, and
`onnxgen.load(..., tensor_parallel=2)` (gloo, a worker process) against the single-process native decoder on
the same package: greedy tokens and logits, sessions and reuse, saved KV, the workers' lifetime, and the graphs
the pass refuses.

The pass is checked without processes too: the ranks run as threads over an in-process all-reduce, so each
world size costs one lowering per rank.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import onnxgen  # noqa: E402
from onnxgen.backends.native.decoder import NativeDecoder  # noqa: E402
from onnxgen.backends.native.lowering import lower  # noqa: E402
from onnxgen.backends.native.tp.shard import Sharder, head_split  # noqa: E402
from onnxgen.convert.synthetic import SyntheticConfig, write_package  # noqa: E402
from onnxgen.errors import BackendUnavailable, InvalidRequest, UnsupportedSharding  # noqa: E402
from onnxgen.package.spec import load_spec  # noqa: E402

PROMPT = [5, 17, 42, 99, 3, 250, 7, 81, 64, 12, 200, 33]


class ThreadComm:
    """An all-reduce between threads (each rank a thread): what `tp.comm.Comm` does between processes."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world)
        self.parts: list[Any] = [None] * world

    def rank(self, r: int) -> Any:
        comm = self

        class View:
            def all_reduce(self, x: Any) -> Any:
                comm.parts[r] = x.clone()
                comm.barrier.wait()
                total = sum(comm.parts[1:], comm.parts[0].clone())
                comm.barrier.wait()
                return x.copy_(total)

        return View()


def threaded_logits(spec: Any, world: int, steps: list[tuple[list[int], int]]) -> list[list[Any]]:
    """Each rank's logits for `steps` (tokens, start) run in order, ranks as threads."""
    comm = ThreadComm(world)
    out: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            sh = Sharder(r, world, comm.rank(r))
            prog = lower(spec.decoder_path, spec, torch.device("cpu"), shard=sh)
            local = dataclasses.replace(spec, num_heads=sh.heads, num_kv_heads=sh.kv_heads)
            d = NativeDecoder(local, _program=prog)
            out[r] = [d.forward(t, s) for t, s in steps]
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
            comm.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def test_head_split_keeps_whole_groups_or_one_kv_head():
    assert head_split(9, 3, 0, 2) == (0, 3, 0, 1) and head_split(9, 3, 1, 2) == (3, 9, 1, 3)
    assert [head_split(4, 2, r, 4) for r in range(4)] == [
        (0, 1, 0, 1),
        (1, 2, 0, 1),
        (2, 3, 1, 2),
        (3, 4, 1, 2),
    ]
    assert head_split(32, 8, 3, 4) == (24, 32, 6, 8)
    assert head_split(6, 2, 0, 4) is None  # 6 query heads cannot be split evenly over 4 ranks
    assert head_split(4, 1, 0, 3) is None


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_ranks_compute_the_unsharded_logits(tiny_dir: Path, world: int):
    """4 query heads in 2 KV groups: over 2 ranks the KV heads split; over 4 each rank one query head and its
    KV head (replicated); over 3 no even split inside the groups (refused)."""
    spec = load_spec(tiny_dir)
    steps = [(PROMPT, 0), ([9], len(PROMPT)), ([11], len(PROMPT) + 1)]
    ref = NativeDecoder(spec)
    want = [ref.forward(t, s) for t, s in steps]
    if head_split(spec.num_heads, spec.num_kv_heads, 0, world) is None:
        with pytest.raises(UnsupportedSharding, match="GroupQueryAttention"):
            threaded_logits(spec, world, steps)
        return
    for rank_out in threaded_logits(spec, world, steps):
        for got, exp in zip(rank_out, want, strict=True):
            assert torch.allclose(got, exp, atol=1e-4, rtol=0)
            assert int(got.argmax()) == int(exp.argmax())


def test_rank_weights_are_its_part(tiny_dir: Path):
    spec = load_spec(tiny_dir)
    whole = lower(spec.decoder_path, spec, torch.device("cpu"))
    sh = Sharder(1, 2, ThreadComm(2).rank(1))
    part = lower(spec.decoder_path, spec, torch.device("cpu"), shard=sh)
    # 2 layers: attention output and down projections row-parallel, QKV / gate / up column-parallel
    assert sh.sharded == {"row": 4, "column": 6} and (sh.heads, sh.kv_heads) == (2, 1)
    assert sum(1 for s in part.steps if s.node.op == "AllReduce") == 4
    # each layer's products (QKV 8 heads of 16, o, gate, up, down: fp32): half of each on this rank; the
    # embedding, lm_head and rotary tables replicated
    h, i, qkv = spec.hidden_size, 128, (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_size
    layer_bytes = 4 * (h * qkv + h * h + 3 * h * i)
    assert whole.weight_bytes - part.weight_bytes == spec.num_layers * layer_bytes // 2


@pytest.mark.parametrize(
    ("cfg", "node"),
    [
        (SyntheticConfig(num_layers=1, context_length=256, attention="plain"), "Concat"),
        (SyntheticConfig(num_layers=1, context_length=256, attention="onnx23"), "Attention"),
        (SyntheticConfig(num_layers=1, context_length=256, quant="int4"), "MatMulNBits"),
    ],
)
def test_graphs_it_cannot_shard_are_refused_by_name(tmp_path: Path, cfg: SyntheticConfig, node: str):
    spec = load_spec(write_package(tmp_path / "pkg", cfg))
    with pytest.raises(UnsupportedSharding, match=node) as info:
        lower(spec.decoder_path, spec, torch.device("cpu"), shard=Sharder(0, 2, ThreadComm(2).rank(0)))
    assert info.value.node and "tensor_parallel=1" in str(info.value)


# --- processes ------------------------------------------------------------------------------------------


def tp_children() -> list[Any]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("onnxgen-tp")]


@pytest.fixture(scope="module")
def tiny_pair(tiny_dir: Path):
    one = onnxgen.load(str(tiny_dir), backend="native", paged=False)
    two = onnxgen.load(str(tiny_dir), backend="native", tensor_parallel=2)
    yield one, two
    two.close()


def greedy(model: Any, prompt: Any, n: int = 12, **kw: Any) -> Any:
    return model.generate(prompt, max_new_tokens=n, temperature=0, output_logits=True, **kw)


def test_tp2_greedy_equals_one_process(tiny_pair):
    one, two = tiny_pair
    assert len(tp_children()) >= 1
    for prompt in (PROMPT, "The capital of France is", [1, 2, 3]):
        a, b = greedy(one, prompt), greedy(two, prompt)
        assert b.tokens == a.tokens
        assert abs(b.logits - a.logits).max() <= 1e-4 * abs(a.logits).max()


def test_tp2_session_reuses_its_prefix_and_equals_a_fresh_run(tiny_pair):
    one, two = tiny_pair
    s = two.session()
    r1 = greedy(s, PROMPT)
    turn2 = PROMPT + r1.tokens + [70, 71, 72]
    r2 = greedy(s, turn2)
    assert r2.stats.reused_tokens == len(PROMPT) + len(r1.tokens) - 1
    fresh = greedy(two, turn2, reuse=False)
    alone = greedy(one, turn2, reuse=False)
    assert r2.tokens == fresh.tokens == alone.tokens
    back = greedy(s, PROMPT[:6])  # a rewind on every rank
    assert back.stats.reused_tokens == 5 and back.tokens == greedy(one, PROMPT[:6], reuse=False).tokens
    s.close()


def test_tp2_a_refused_request_leaves_the_group_working(tiny_pair):
    one, two = tiny_pair
    from onnxgen.errors import ContextOverflow

    with pytest.raises((ContextOverflow, InvalidRequest)):
        two.generate([5] * 1100, max_new_tokens=1)
    assert greedy(two, PROMPT).tokens == greedy(one, PROMPT).tokens


def test_tp2_saved_kv_is_the_whole_cache(tiny_dir: Path):
    from onnxgen.backends.native.tp.decoder import TPDecoder

    spec = load_spec(tiny_dir)
    ref = NativeDecoder(spec)
    d = TPDecoder.start(spec, "cpu", 2)
    try:
        ref.forward(PROMPT, 0)
        d.forward(PROMPT, 0)
        got, want = d.export_kv(), ref.export_kv()
        assert [k.shape for k, _ in got] == [k.shape for k, _ in want]
        for (k, v), (k0, v0) in zip(got, want, strict=True):
            assert abs(k - k0).max() < 1e-5 and abs(v - v0).max() < 1e-5
        f = d.fork()
        f.import_kv(PROMPT, want)
        assert torch.allclose(f.forward([9], len(PROMPT)), ref.forward([9], len(PROMPT)), atol=1e-4)
    finally:
        d.shutdown()
    assert d.workers == []
    with pytest.raises(BackendUnavailable, match="stopped"):
        d.forward([1], d.kv_len())


def test_closing_the_model_ends_its_workers(tiny_dir: Path):
    before = {p.pid for p in tp_children()}
    model = onnxgen.load(str(tiny_dir), backend="native", tensor_parallel=2)
    mine = [p for p in tp_children() if p.pid not in before]
    assert len(mine) == 1 and mine[0].is_alive()
    greedy(model, PROMPT, n=2)
    model.close()
    assert not mine[0].is_alive()
    with pytest.raises(BackendUnavailable, match="closed"):
        model.generate(PROMPT, max_new_tokens=1)


def test_a_graph_it_cannot_shard_fails_the_load_and_leaves_no_worker(tiny_plain_dir: Path):
    before = {p.pid for p in tp_children()}
    with pytest.raises(UnsupportedSharding, match="KVConcat"):
        onnxgen.load(str(tiny_plain_dir), backend="native", tensor_parallel=2)
    assert {p.pid for p in tp_children()} <= before


def test_tensor_parallel_options_are_checked(tiny_dir: Path):
    with pytest.raises(InvalidRequest, match="tensor_parallel"):
        onnxgen.load(str(tiny_dir), backend="native", tensor_parallel=0)
    with pytest.raises(InvalidRequest, match="native backend"):
        onnxgen.load(str(tiny_dir), backend="ort", tensor_parallel=2)
    with pytest.raises(BackendUnavailable, match="paged"):
        onnxgen.load(str(tiny_dir), backend="native", tensor_parallel=2, paged=True)


def test_tp2_default_model_greedy_equals_one_process(smollm2_dir: Path):
    """The builder-made default model: 9 query heads in 3 KV groups, split unevenly (1 + 2 groups)."""
    one = onnxgen.load(str(smollm2_dir), backend="native", paged=False)
    two = onnxgen.load(str(smollm2_dir), backend="native", tensor_parallel=2)
    try:
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        a, b = greedy(one, msgs, n=16), greedy(two, msgs, n=16)
        assert b.tokens == a.tokens
        assert abs(b.logits - a.logits).max() <= 1e-3 * abs(a.logits).max()
    finally:
        two.close()


def test_workers_exit_when_rank_0_dies(tiny_dir: Path):
    """Rank 0 killed outright (no finalizer runs): its workers see their pipe close and exit."""
    import subprocess
    import sys
    import time

    code = (
        "import onnxgen, multiprocessing, sys, time\n"
        f"m = onnxgen.load({str(tiny_dir)!r}, backend='native', tensor_parallel=2)\n"
        "print(*[p.pid for p in multiprocessing.active_children() if p.name.startswith('onnxgen-tp')], flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in proc.stdout.readline().split()]
        assert len(pids) == 1
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _running(pids[0]):
            time.sleep(0.1)
        assert not _running(pids[0])
    finally:
        proc.kill()


def _running(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False
