"""The batched native runner: ragged batches over the paged pool give each sequence the logits it gets
alone (batch-1 `NativeDecoder` on its own contiguous KV), prefill chunks and decodes mixed in one step."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from onnxgen.backends.batch import BatchStep, SeqChunk  # noqa: E402
from onnxgen.backends.native.decoder import NativeDecoder  # noqa: E402
from onnxgen.backends.native.runner import VERIFY_GRAPH_TOKENS, NativeRunner  # noqa: E402
from onnxgen.errors import BackendUnavailable  # noqa: E402
from onnxgen.package.spec import load_spec  # noqa: E402


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def _check_ragged(spec, tol: float) -> None:
    runner = NativeRunner(spec, kv_bytes=64 << 20)
    vocab = spec.vocab_size
    # three sequences with interleaved (non-contiguous, out-of-order) pages
    seqs = {"a": _tokens(45, 1, vocab), "b": _tokens(7, 2, vocab), "c": _tokens(30, 3, vocab)}
    pages = {"a": [9, 2, 5], "b": [0], "c": [7, 1]}
    alone = {k: NativeDecoder(spec) for k in seqs}
    # (name, start, n) per step: prefills, chunks after cached tokens, decodes, all mixed
    plan = [
        [("a", 0, 20), ("b", 0, 7)],
        [("a", 20, 1), ("b", 7, 0), ("c", 0, 16)],
        [("c", 16, 14), ("a", 21, 24)],
        [("a", 45, 1), ("c", 30, 1), ("b", 7, 1)],
    ]
    for step_plan in plan:
        chunks, want = [], []
        for name, start, n in step_plan:
            toks = seqs[name]
            if start + n > len(toks):
                toks.extend(_tokens(start + n - len(toks), start, vocab))
            if n == 0:
                continue
            chunks.append(SeqChunk(tokens=toks[start : start + n], start=start, pages=pages[name]))
            want.append(alone[name].forward(toks[start : start + n], start))
        got = runner.run(BatchStep(tuple(chunks)))
        assert got.shape == (len(chunks), vocab)
        for row, ref in zip(got, want, strict=True):
            assert _rel(row, ref) <= tol
            assert int(row.argmax()) == int(ref.argmax())


def test_ragged_batch_equals_each_sequence_alone_fp32(tiny_dir: Path) -> None:
    _check_ragged(load_spec(tiny_dir), 1e-5)


def test_ragged_batch_equals_each_sequence_alone_bf16(tmp_path: Path) -> None:
    from onnxgen.convert.synthetic import SyntheticConfig, write_package

    cfg = SyntheticConfig(
        num_layers=2,
        hidden_size=256,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=512,
        vocab_size=384,
        dtype="bfloat16",
    )
    _check_ragged(load_spec(write_package(tmp_path / "bf16", cfg)), 2e-2)


def test_only_fused_attention_packages_are_batched(tiny_plain_dir: Path) -> None:
    with pytest.raises(BackendUnavailable, match="cannot batch"):
        NativeRunner(load_spec(tiny_plain_dir), kv_bytes=1 << 20)


def test_logits_only_for_chunks_that_ask(tiny_dir: Path) -> None:
    spec = load_spec(tiny_dir)
    runner = NativeRunner(spec, kv_bytes=8 << 20)
    step = BatchStep((SeqChunk([5, 6, 7], 0, [0], logits=False), SeqChunk([8, 9], 0, [1], logits=True)))
    got = runner.run(step)
    ref = NativeDecoder(spec).forward([8, 9], 0)
    assert got.shape[0] == 1 and _rel(got[0], ref) <= 1e-5


def _verify_rows_are_decode_bits(device: str, dtype: str, tmp_path: Path, graphs: bool) -> None:
    """Speculative decoding's exactness: a verify step (one sequence, a logits row per fed token) gives each
    row the bits a one-token decode step at that position gives, so accepting drafts returns plain greedy
    decoding's tokens. Decode 12 tokens one by one after a 300-token prompt (several key splits), then
    verify the same tokens at the same positions in chunks of 3, 4 and 5 (graph sizes 4 and 8, padded or not),
    with another request's decode in the step for the last one."""
    from onnxgen.convert.synthetic import SyntheticConfig, write_package

    cfg = SyntheticConfig(
        num_layers=2,
        hidden_size=256,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=512,
        vocab_size=384,
        dtype=dtype,
        context_length=4096,
    )
    spec = load_spec(write_package(tmp_path / "pkg", cfg))
    runner = NativeRunner(spec, device, kv_bytes=32 << 20, max_batch=2, cuda_graphs=graphs)
    assert runner.cuda_graphs == graphs
    toks = _tokens(312, 5, spec.vocab_size)
    pages, other = list(range(10, 40)), list(range(50, 60))
    runner.run(BatchStep((SeqChunk(toks[:300], 0, pages), SeqChunk(toks[:20], 0, other))))
    dec = [runner.run(BatchStep((SeqChunk([toks[p]], p, pages),)))[0].clone() for p in range(300, 312)]
    start = 300
    for n in (3, 4, 5):
        chunks = [SeqChunk(toks[start : start + n], start, pages, n)]
        if n == 5:
            chunks.append(SeqChunk([toks[20]], 20, other))
        got = runner.run(BatchStep(tuple(chunks)))
        for i in range(n):
            assert torch.equal(got[i], dec[start - 300 + i]), (n, i)
        start += n


def test_verify_steps_and_only_they_are_computed_rowwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step is rowwise when each chunk wants every fed position's logits and some chunk has several
    (draft verification, alone or beside decodes), within `kernels.linear.ROWWISE_ROWS` rows; never for
    decodes or prefill chunks, nor with ONNXGEN_ROWWISE=0 (read by the runner at load)."""
    from onnxgen import envs
    from onnxgen.backends.native import batching
    from onnxgen.backends.native.kernels.linear import ROWWISE_ROWS

    verify = SeqChunk([1, 2, 3], 10, [0], 3)
    decode = SeqChunk([4], 20, [1], 1)
    assert batching.computes_rowwise(BatchStep((verify,))) and batching.computes_rowwise(
        BatchStep((verify, decode))
    )
    assert not batching.computes_rowwise(BatchStep((decode,))) and not batching.computes_rowwise(
        BatchStep((decode, SeqChunk([5], 3, [2])))
    )
    assert not batching.computes_rowwise(BatchStep((SeqChunk([1, 2, 3], 0, [0], 1),)))  # a prefill chunk
    assert not batching.computes_rowwise(
        BatchStep((verify, SeqChunk([1, 2], 0, [3], 1)))
    )  # beside a prefill chunk
    n = ROWWISE_ROWS
    assert batching.computes_rowwise(BatchStep((SeqChunk(list(range(n)), 0, [0, 1, 2, 3], n),)))
    assert not batching.computes_rowwise(
        BatchStep((SeqChunk(list(range(n + 1)), 0, [0, 1, 2, 3, 4], n + 1),))
    )
    monkeypatch.setenv("ONNXGEN_ROWWISE", "0")
    assert not batching.computes_rowwise(BatchStep((verify,)), envs.ROWWISE)


def test_decode_runs_replay_the_short_context_graph_while_they_stay_within_its_keys(tmp_path: Path) -> None:
    """`NativeRunner._decode_graph`: a run of k decode steps replays its batch bucket's short-context graph
    (unpipelined attention, `paged.short_keys`) only while every sequence's KV length stays within that
    graph's `keys` through the run's last step; otherwise, and for buckets without one, the graph for any
    length. (Which graph is chosen; the graphs themselves are GPU-tested.)"""
    from onnxgen.backends.native.graphs import Captured, GraphKey
    from onnxgen.convert.synthetic import SyntheticConfig, write_package

    spec = load_spec(write_package(tmp_path / "pkg", SyntheticConfig(num_layers=1, context_length=512)))
    runner = NativeRunner(spec, "cpu", kv_bytes=8 << 20, cuda_graphs=False)
    keys = (GraphKey("decode", 1), GraphKey("decode", 2), GraphKey("decode", 1, kv=100))
    long1, long2, short1 = (Captured(key, None, None, None) for key in keys)
    runner._graph_batches = [1, 2]
    for g in (long1, long2, short1):
        runner._graphs.put(g)
    runner._short = {1: 100}

    def step(*starts: int) -> BatchStep:
        return BatchStep(tuple(SeqChunk([1], s, [0]) for s in starts))

    assert runner._decode_graph(step(90), 10) is short1  # KV lengths 91..100 within 100
    assert runner._decode_graph(step(90), 11) is long1  # the run's last step reaches 101
    assert runner._decode_graph(step(99), 1) is short1 and runner._decode_graph(step(100), 1) is long1
    assert runner._decode_graph(step(5, 6), 1) is long2  # bucket 2 has no short graph
    assert runner._decode_graph(step(1, 2, 3), 1) is None  # no bucket that large


def test_graphs_hold_captured_steps_by_key_and_forget_them_on_clear() -> None:
    """`graphs.Graphs` bookkeeping (no capture: that is GPU-tested): a step is held under its `GraphKey`
    (kind, batch, tokens, KV bound all part of the key), replaced by a step under the same key, listed in
    insertion order, and dropped with every failure mark by `clear`."""
    from onnxgen.backends.native.graphs import Captured, GraphKey, Graphs

    graphs: Graphs[str] = Graphs(torch.device("cpu"))
    decode, short = GraphKey("decode", 8), GraphKey("decode", 8, kv=1024)
    assert decode != short and decode == GraphKey("decode", batch=8, tokens=1, kv=0)
    graphs.put(Captured(decode, "inputs", None, "out"))
    graphs.put(Captured(short, "short", None, None))
    assert len(graphs) == 2 and list(graphs) == [decode, short]
    assert graphs.get(decode).out == "out" and graphs.get(GraphKey("prefill", tokens=16)) is None
    graphs.put(Captured(decode, "again", None, None))
    assert len(graphs) == 2 and graphs.get(decode).inputs == "again"
    assert not graphs.failed(decode)
    graphs.clear()
    assert len(graphs) == 0 and graphs.get(short) is None


def test_runner_options_part_steps_and_first_multi(tiny_dir: Path) -> None:
    """`part_steps` (declared in `RUNNER_OPTIONS`) sets the parts a run is read in on the CPU too (0: one
    part); a negative or non-int value is refused naming the option."""
    from onnxgen.backends.native import RUNNER_OPTIONS
    from onnxgen.backends.native.runs import DecodeRun
    from onnxgen.errors import InvalidRequest

    assert {"part_steps", "first_multi"} <= set(RUNNER_OPTIONS)
    spec = load_spec(tiny_dir)
    for part_steps, want in ((4, (4, 8, 10)), (3, (3, 6, 9, 10)), (0, (10,))):
        runner = NativeRunner(spec, kv_bytes=8 << 20, part_steps=part_steps, first_multi=False)
        assert runner.decode_parts(DecodeRun(torch.empty(10, 1))) == want
    for bad in (-1, 2.0, True):
        with pytest.raises(InvalidRequest, match="part_steps"):
            NativeRunner(spec, kv_bytes=8 << 20, part_steps=bad)


def test_interpreted_verify_rows_are_the_bits_of_decode_steps(tmp_path: Path) -> None:
    """The same on the CPU through the Triton kernels (`ONNXGEN_FORCE_TRITON=1` under `TRITON_INTERPRET=1`;
    skipped elsewhere: the CPU's torch path makes no such promise in low precision)."""
    from onnxgen import envs

    if not envs.FORCE_TRITON or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(
            "runs the Triton kernels on the CPU only under TRITON_INTERPRET=1 and ONNXGEN_FORCE_TRITON=1"
        )
    _verify_rows_are_decode_bits(
        "cpu", "bfloat16", tmp_path, graphs=False
    )  # (float32 on the CPU: [K, N] torch products)


# --- GPU ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_short_context_decode_graph_gives_the_bits_of_the_graph_for_any_length(tmp_path: Path) -> None:
    """The short-context decode graph (its attention unpipelined) gives the bits of the graph for any length
    at every position it may run, and `run` switches from it to that graph as the KV grows past its keys."""
    from onnxgen.convert.synthetic import SyntheticConfig, write_package

    cfg = SyntheticConfig(
        num_layers=2,
        hidden_size=256,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=512,
        vocab_size=384,
        dtype="bfloat16",
        context_length=4096,
    )
    spec = load_spec(write_package(tmp_path / "pkg", cfg))
    from onnxgen.backends.native.graphs import GraphKey

    gpu = NativeRunner(spec, "cuda", kv_bytes=32 << 20, max_batch=2)
    keys = gpu._short[1]
    short, full = gpu._graphs.get(GraphKey("decode", 1, kv=keys)), gpu._graphs.get(GraphKey("decode", 1))
    assert short is not None and full is not None
    assert 1024 <= keys < spec.context_length
    n = keys - 3
    toks = _tokens(n + 6, 7, spec.vocab_size)
    pages = list(range(-(-(n + 6) // gpu.page_size)))
    gpu.run(BatchStep((SeqChunk(toks[:n], 0, pages),)))  # the prompt, eagerly
    for p in range(n, n + 6):  # KV lengths keys - 2 .. keys + 3
        step = BatchStep((SeqChunk([toks[p]], p, pages),))
        assert gpu._graph_for(step) is (short if p + 1 <= keys else full)
        want = gpu._run_graph(full, step)[0].clone()
        if p + 1 <= keys:
            assert torch.equal(gpu._run_graph(short, step)[0], want), p
        assert torch.equal(gpu.run(step)[0], want), p


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_decode_steps_equal_each_sequence_alone(tmp_path: Path, dtype: str) -> None:
    """Decode steps replayed from CUDA graphs (batch sizes changing inside one bucket, so padding rows
    take over rows that were real a step before) give every sequence its own logits, as the CPU decoder."""
    from onnxgen.convert.synthetic import SyntheticConfig, write_package

    cfg = SyntheticConfig(
        num_layers=2,
        hidden_size=256,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=512,
        vocab_size=384,
        dtype=dtype,
        context_length=1024,
    )
    spec = load_spec(write_package(tmp_path / "pkg", cfg))
    gpu = NativeRunner(spec, "cuda", kv_bytes=32 << 20, max_batch=8)
    assert gpu.cuda_graphs
    tol = 1e-4 if dtype == "float32" else 3e-2
    names = list(range(6))
    toks = {k: _tokens(20 + 7 * k, k, spec.vocab_size) for k in names}
    pages = {k: [40 * k + i for i in range(40)] for k in names}
    alone = {k: NativeDecoder(spec) for k in names}
    got = gpu.run(BatchStep(tuple(SeqChunk(toks[k], 0, pages[k]) for k in names)))  # one eager prefill step
    for k in names:
        assert _rel(got[k].cpu(), alone[k].forward(toks[k], 0)) <= tol
    for step, batch in enumerate([names, names[:5], [0, 2], names, [5], names[1:]]):
        chunks, want = [], []
        for k in batch:
            t = int(_tokens(1, 100 * step + k, spec.vocab_size)[0])
            chunks.append(SeqChunk([t], len(toks[k]), pages[k]))
            want.append(alone[k].forward([t], len(toks[k])))
            toks[k].append(t)
        rows = gpu.run(BatchStep(tuple(chunks)))
        for row, ref in zip(rows, want, strict=True):
            assert _rel(row.cpu(), ref) <= tol
    assert gpu.steps["graph"] == 6 and gpu.steps["eager"] == 1


@pytest.mark.gpu
def test_cuda_graph_prefill_chunks_equal_the_cpu_path(tiny_dir: Path) -> None:
    """One sequence's prefill chunks replayed from graphs padded to the next captured size (the padding's keys go to
    the scratch page): each chunk's logits and the decode after them equal the CPU decoder's, and the
    sequence's pages past its length are untouched by the padding."""
    spec = load_spec(tiny_dir)
    gpu = NativeRunner(spec, "cuda", kv_bytes=16 << 20, max_batch=4)
    cpu = NativeDecoder(spec)
    toks = _tokens(900, 9, spec.vocab_size)
    pages = list(range(100, 160))
    start = 0
    for n in (7, 20, 33, 100, 300, 1):
        chunk = toks[start : start + n]
        before = gpu.storage.data[:, :, pages].clone()
        got = gpu.run(BatchStep((SeqChunk(chunk, start, pages),)))
        ref = cpu.forward(chunk, start)
        assert _rel(got[0].cpu(), ref) <= 1e-4, (start, n)
        after = gpu.storage.data[:, :, pages]
        flat_b = before.flatten(2, 3)  # [layers, 2, positions, heads, dim]
        flat_a = after.flatten(2, 3)
        assert torch.equal(flat_a[:, :, start + n :], flat_b[:, :, start + n :]), (
            "padding wrote into the pool"
        )
        start += n
    assert gpu.steps["graph"] == 6 and gpu.steps["eager"] == 0


@pytest.mark.gpu
def test_cuda_verify_steps_replay_graphs_equal_the_cpu_path(tiny_dir: Path) -> None:
    """Draft verification (one sequence, a logits row per fed position) replays a verify graph captured on
    first use: every row equals the CPU decoder's, for draft counts inside and at a graph's size."""
    spec = load_spec(tiny_dir)
    gpu = NativeRunner(spec, "cuda", kv_bytes=16 << 20, max_batch=4)
    cpu = NativeDecoder(spec)
    toks = _tokens(200, 4, spec.vocab_size)
    pages = list(range(10, 40))
    first = toks[:50]
    gpu.run(BatchStep((SeqChunk(first, 0, pages),)))
    cpu.forward(first, 0)
    start = 50
    graphs_before = gpu.steps["graph"]
    for n in (3, 4, 7, 16):
        chunk = toks[start : start + n]
        got = gpu.run(BatchStep((SeqChunk(chunk, start, pages, n),)))
        want = cpu.forward(chunk, start, rows=n)
        assert got.shape[0] == n
        for i in range(n):
            assert _rel(got[i].cpu(), want[i]) <= 1e-4, (n, i)
        start += n
    assert gpu.steps["graph"] - graphs_before == 4, "every verify step replayed a graph"
    from onnxgen.backends.native.graphs import GraphKey

    captured = [m for m in VERIFY_GRAPH_TOKENS if gpu._graphs.get(GraphKey("verify", tokens=m)) is not None]
    assert captured == [4, 8, 16]


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_verify_rows_are_the_bits_of_decode_steps(tmp_path: Path, dtype: str, graphs: bool) -> None:
    _verify_rows_are_decode_bits("cuda", dtype, tmp_path, graphs)
