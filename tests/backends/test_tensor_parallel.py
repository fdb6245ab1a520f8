"""Tensor parallelism (`backends/native/tp`) on the CPU: the sharding pass against the unsharded program, and
`onnxgen.load(..., tensor_parallel=2)` (gloo, a worker process) against the single-process native backend on
the same package, with a decoder per request and with the paged batched runner: greedy tokens and logits,
concurrent requests, sessions and reuse, prefix sharing, a pool under pressure, saved KV, the workers'
lifetime, and the graphs the pass refuses.

The pass is checked without processes too: the ranks run as threads over an in-process all-reduce, so each
world size costs one lowering per rank.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import onnxgen  # noqa: E402
from onnxgen.backends.native.decoder import NativeDecoder  # noqa: E402
from onnxgen.backends.native.lowering import lower  # noqa: E402
from onnxgen.backends.native.tp.shard import Sharder, even_split, head_split  # noqa: E402
from onnxgen.convert.synthetic import SyntheticConfig, write_package  # noqa: E402
from onnxgen.errors import BackendUnavailable, InvalidRequest, UnsupportedSharding  # noqa: E402
from onnxgen.package.spec import load_spec  # noqa: E402

PROMPT = [5, 17, 42, 99, 3, 250, 7, 81, 64, 12, 200, 33]


class ThreadComm:
    """An all-reduce and an all-gather between threads (each rank a thread): what `tp.comm.Comm` does between
    processes."""

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

            def all_gather(self, x: Any) -> Any:
                comm.parts[r] = x.clone()
                comm.barrier.wait()
                out = torch.stack(comm.parts)
                comm.barrier.wait()
                return out

        return View()


def threaded_logits(
    spec: Any,
    world: int,
    steps: list[tuple[list[int], int]],
    int4: str = "dense",
    ranks: list[Any] | None = None,
) -> list[list[Any]]:
    """Each rank's logits for `steps` (tokens, start) run in order, ranks as threads. `ranks`, when given,
    gets each rank's `(Sharder, Program)` in rank order."""
    comm = ThreadComm(world)
    out: list[Any] = [None] * world
    kept: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            sh = Sharder(r, world, comm.rank(r))
            prog = lower(spec.decoder_path, spec, torch.device("cpu"), int4, shard=sh)
            kept[r] = (sh, prog)
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
    if ranks is not None:
        ranks.extend(kept)
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


@pytest.mark.parametrize("quant", [None, "int4"])
def test_rank_weights_are_its_part(tiny_dir: Path, tiny_int4_dir: Path, quant: str | None):
    """fp32 products cut, or int4 ones cut on their packed constants (then dequantized to fp32 at load)."""
    spec = load_spec(tiny_int4_dir if quant else tiny_dir)
    whole = lower(spec.decoder_path, spec, torch.device("cpu"))
    sh = Sharder(1, 2, ThreadComm(2).rank(1))
    part = lower(spec.decoder_path, spec, torch.device("cpu"), shard=sh)
    # 2 layers: attention output and down projections row-parallel, QKV / gate / up column-parallel, the
    # lm_head vocab-parallel (the second half of the vocabulary)
    assert sh.sharded == {"row": 4, "column": 6, "vocab": 1} and (sh.heads, sh.kv_heads) == (2, 1)
    assert sh.vocab == (spec.vocab_size // 2, spec.vocab_size)
    assert sum(1 for s in part.steps if s.node.op == "AllReduce") == 4
    assert sum(1 for s in part.steps if s.node.op == "AllGather") == 1
    # each layer's products (QKV 8 heads of 16, o, gate, up, down: fp32) and the lm_head: half of each on
    # this rank; the embedding and rotary tables replicated
    h, i, qkv = spec.hidden_size, 128, (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_size
    layer_bytes = 4 * (h * qkv + h * h + 3 * h * i)
    lm_head_bytes = 4 * h * spec.vocab_size
    assert whole.weight_bytes - part.weight_bytes == (spec.num_layers * layer_bytes + lm_head_bytes) // 2


# --- the vocab-parallel lm_head ------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[None, "int4"])
def tied_vocab_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tied embeddings, a vocabulary of 385 (split unevenly over 2, 3 and 4 ranks), 6 heads in 6 KV groups
    (split over 2, 3 and 4 ranks): fp32 (the embedding gathered from the lm_head weight's Transpose) or
    int4 (GatherBlockQuantized over the lm_head's packed MatMulNBits weights; heads of 32, one block each)."""
    quant = request.param
    cfg = SyntheticConfig(
        num_layers=1,
        context_length=256,
        hidden_size=192 if quant else 96,
        num_heads=6,
        num_kv_heads=6,
        vocab_size=385,
        tie_embeddings=True,
        quant=quant,
    )
    return write_package(tmp_path_factory.mktemp(f"tied_{quant}") / "pkg", cfg)


def _const_inputs(prog: Any, step: Any) -> list[Any]:
    return [prog.consts[i] for i in step.ins if i in prog.consts]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_vocab_parallel_lm_head_gathers_the_unsharded_logits(tied_vocab_dir: Path, world: int):
    """Each rank computes its (uneven) slice of the vocabulary's logits from its rows of the lm_head alone;
    one all-gather joins them into the unsharded logits on every rank; the tied embedding stays whole."""
    spec = load_spec(tied_vocab_dir)
    v, h = spec.vocab_size, spec.hidden_size
    steps = [(PROMPT, 0), ([9], len(PROMPT)), ([11], len(PROMPT) + 1)]
    ref = NativeDecoder(spec)
    want = [ref.forward(t, s) for t, s in steps]
    ranks: list[Any] = []
    for rank_out in threaded_logits(spec, world, steps, ranks=ranks):
        for got, exp in zip(rank_out, want, strict=True):
            assert got.shape == exp.shape
            assert torch.allclose(got, exp, atol=1e-4, rtol=0)
            assert int(got.argmax()) == int(exp.argmax())
    held = 0
    for r, (sh, prog) in enumerate(ranks):
        a, b = even_split(v, r, world)
        assert sh.vocab == (a, b) and sh.sharded["vocab"] == 1
        (gather,) = [s for s in prog.steps if s.node.op == "AllGather"]
        assert prog.logits_slot in gather.outs
        (head,) = [s for s in prog.steps if gather.ins[0] in s.outs]
        weight = max(_const_inputs(prog, head), key=lambda t: t.numel())
        assert weight.numel() == (b - a) * h  # this rank's vocabulary rows of the lm_head only (fp32)
        held += weight.numel() * weight.element_size()
        (embed,) = [s for s in prog.steps if s.node.op in ("Gather", "GatherBlockQuantized")]
        table = max(_const_inputs(prog, embed), key=lambda t: t.numel())
        assert table.shape == (v, h)  # the tied embedding whole
    assert held == 4 * v * h  # the ranks' slices: the lm_head once


def test_an_lm_head_it_cannot_split_stays_replicated(tiny_dir: Path, tmp_path: Path):
    """A bias of shape [1, vocab] added to the logits (not a per-vocab vector the pass cuts): the lm_head
    stays whole on every rank, no all-gather, the logits still the unsharded ones."""
    import shutil

    import onnx
    from onnx import helper, numpy_helper

    shutil.copytree(tiny_dir, tmp_path / "pkg")
    model = onnx.load(str(tmp_path / "pkg" / "model.onnx"), load_external_data=False)
    (last,) = [n for n in model.graph.node if "logits" in n.output]
    last.output[list(last.output).index("logits")] = "logits_unbiased"
    bias = np.random.default_rng(0).standard_normal((1, 384)).astype(np.float32)
    model.graph.initializer.append(numpy_helper.from_array(bias, "logits_bias"))
    model.graph.node.append(helper.make_node("Add", ["logits_unbiased", "logits_bias"], ["logits"], "bias"))
    onnx.save(model, str(tmp_path / "pkg" / "model.onnx"))
    spec = load_spec(tmp_path / "pkg")
    ranks: list[Any] = []
    steps = [(PROMPT, 0), ([9], len(PROMPT))]
    ref = NativeDecoder(spec)
    want = [ref.forward(t, s) for t, s in steps]
    for rank_out in threaded_logits(spec, 2, steps, ranks=ranks):
        for got, exp in zip(rank_out, want, strict=True):
            assert torch.allclose(got, exp, atol=1e-4, rtol=0)
    for sh, prog in ranks:
        assert sh.vocab is None and "vocab" not in sh.sharded
        assert not any(s.node.op == "AllGather" for s in prog.steps)


# --- int4 (MatMulNBits) products: cut on their packed constants ---------------------------------------------


@pytest.fixture(scope="module")
def tiny_int4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every product (lm_head too) int4 MatMulNBits, block 32, with packed zero points: 4 heads of 16, so the
    attention output projection's 64 input features are 2 blocks."""
    cfg = SyntheticConfig(num_layers=2, context_length=1024, quant="int4", quant_zero_points=True)
    return write_package(tmp_path_factory.mktemp("tiny_int4") / "pkg", cfg)


@pytest.fixture(scope="module")
def int4_wide_heads_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """int4 without zero points, 4 heads of 32 in 2 KV groups: one block per head."""
    cfg = SyntheticConfig(num_layers=2, context_length=256, head_size=32, quant="int4")
    return write_package(tmp_path_factory.mktemp("int4_wide") / "pkg", cfg)


def check_threaded(spec: Any, world: int, int4: str = "dense") -> None:
    steps = [(PROMPT, 0), ([9], len(PROMPT)), ([11], len(PROMPT) + 1)]
    ref = NativeDecoder(spec, int4=int4)
    want = [ref.forward(t, s) for t, s in steps]
    for rank_out in threaded_logits(spec, world, steps, int4):
        for got, exp in zip(rank_out, want, strict=True):
            assert torch.allclose(got, exp, atol=1e-4, rtol=0)
            assert int(got.argmax()) == int(exp.argmax())


@pytest.mark.parametrize("int4", ["dense", "packed"])
def test_int4_sharded_ranks_compute_the_unsharded_logits(tiny_int4_dir: Path, int4: str):
    """2 ranks: QKV / gate / up cut by rows of the packed weights, scales and zero points; the attention
    output (1 block each) and down projections (2 blocks each) by whole blocks, the zero points re-packed;
    dequantized at load or kept packed (`int4="packed"`)."""
    check_threaded(load_spec(tiny_int4_dir), 2, int4)


def test_int4_four_ranks_one_block_per_head(int4_wide_heads_dir: Path):
    """4 ranks over 2 KV heads (each replicated on two ranks): each rank one head, one block of the output
    projection and one of the down projection's 4."""
    check_threaded(load_spec(int4_wide_heads_dir), 4)


def test_int4_a_head_that_is_part_of_a_block_is_refused(tiny_int4_dir: Path):
    """4 ranks over heads of 16: each rank's 16 input features of the output projection are half a block."""
    spec = load_spec(tiny_int4_dir)
    with pytest.raises(UnsupportedSharding, match=r"o_proj.*MatMulNBits.*whole int4 blocks of 32") as info:
        lower(spec.decoder_path, spec, torch.device("cpu"), shard=Sharder(0, 4, ThreadComm(4).rank(0)))
    assert "tensor_parallel=4" in str(info.value)


def with_inputs(src: Path, dst: Path, g_idx: str | None, bias: bool = False) -> Path:
    """A copy of package `src` whose every MatMulNBits also reads a g_idx ("trivial": each feature's own
    block; "reordered": reversed) and/or a random bias."""
    import shutil

    import onnx
    from onnx import helper, numpy_helper

    shutil.copytree(src, dst)
    model = onnx.load(str(dst / "model.onnx"), load_external_data=False)
    rng = np.random.default_rng(0)
    for i, node in enumerate(n for n in model.graph.node if n.op_type == "MatMulNBits"):
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        k, nn, block = int(attrs["K"]), int(attrs["N"]), int(attrs["block_size"])
        extra = ["", ""]
        if g_idx:
            g = np.arange(k, dtype=np.int32) // block
            extra[0] = f"g_idx_{i}"
            model.graph.initializer.append(
                numpy_helper.from_array(g if g_idx == "trivial" else g[::-1].copy(), extra[0])
            )
        if bias:
            extra[1] = f"bias_{i}"
            b = rng.standard_normal(nn).astype(np.float32)
            model.graph.initializer.append(numpy_helper.from_array(b, extra[1]))
        while len(node.input) < 4:
            node.input.append("")
        node.input.extend(extra)
    onnx.save(model, str(dst / "model.onnx"))
    return dst


def test_int4_biases_and_a_trivial_g_idx_are_sharded(tiny_int4_dir: Path, tmp_path: Path):
    """Biases: cut with the rows (QKV, gate, up) or added by rank 0 only (output and down projections: a bias
    on every rank would be added twice); a g_idx naming each feature's own block says nothing."""
    check_threaded(load_spec(with_inputs(tiny_int4_dir, tmp_path / "pkg", "trivial", bias=True)), 2)


def test_int4_a_reordering_g_idx_is_refused(tiny_int4_dir: Path, tmp_path: Path):
    spec = load_spec(with_inputs(tiny_int4_dir, tmp_path / "pkg", "reordered"))
    with pytest.raises(UnsupportedSharding, match=r"MatMulNBits.*g_idx"):
        lower(spec.decoder_path, spec, torch.device("cpu"), shard=Sharder(0, 2, ThreadComm(2).rank(0)))


@pytest.mark.parametrize(
    ("cfg", "node"),
    [
        (SyntheticConfig(num_layers=1, context_length=256, attention="plain"), "Concat"),
        (SyntheticConfig(num_layers=1, context_length=256, attention="onnx23"), "Attention"),
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
    two = onnxgen.load(str(tiny_dir), backend="native", tensor_parallel=2, paged=False)
    assert not two.paged
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


# --- the paged runner: a pool per rank, one engine ---------------------------------------------------------

POOL_PAGES = 32  # each rank's pool (tokens: 32 x 16)
PAGE = 16


@pytest.fixture(scope="module")
def paged_pair(tiny_dir: Path):
    """The single-process paged run (the reference) and a TP=2 paged model over a small pool, whose workers
    must be gone after the module: module-scoped, so the tests below share one group."""
    spec = load_spec(tiny_dir)
    page_bytes = 2 * spec.num_layers * PAGE * (spec.num_kv_heads // 2) * spec.head_size * 4  # a rank's heads
    one = onnxgen.load(str(tiny_dir), backend="native", paged=True)
    two = onnxgen.load(
        str(tiny_dir),
        backend="native",
        tensor_parallel=2,
        paged=True,
        kv_bytes=POOL_PAGES * page_bytes,
        max_running=8,
    )
    assert one.paged and two.paged and two.kv_stats()["pages_total"] == POOL_PAGES
    yield one, two
    two.close()


def prompts(seed: int, n: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab - 1, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def concurrent(model: Any, batch: list[list[int]], n: int, **kw: Any) -> list[Any]:
    """`batch` submitted at once (batched into the same steps), greedy."""
    handles = [model.submit(p, max_new_tokens=n, temperature=0, output_logits=True, **kw) for p in batch]
    return [h.result() for h in handles]


def same(got: Any, ref: Any, tol: float = 1e-4) -> None:
    assert got.tokens == ref.tokens
    assert abs(got.logits - ref.logits).max() <= tol * abs(ref.logits).max()


def check_pool(model: Any) -> None:
    """Nothing leaked: every page in use is the index's (no request holds any)."""
    kv = model._engine.executor.kv
    kv.allocator.check_integrity()
    kv.index.check_integrity()
    stats = model.kv_stats()
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["pages_used"] == len(kv.index.pages())


def test_tp2_paged_concurrent_requests_equal_one_process(paged_pair):
    one, two = paged_pair
    batch = prompts(1, 6, 8, 30, two.spec.vocab_size)
    steps = two._engine.executor.runner.local.steps["eager"]
    for got, ref in zip(concurrent(two, batch, 8), concurrent(one, batch, 8), strict=True):
        same(got, ref)
    # batched: 6 requests of 8 tokens each took far fewer steps than one per token and request
    assert two._engine.executor.runner.local.steps["eager"] - steps < 6 * 9
    assert len(two._engine.executor.runner.workers) == 1
    check_pool(two)


def test_tp2_paged_decode_runs_feed_rank_0s_tokens_to_every_rank(paged_pair):
    """Runs of decode steps (CUDA's default, here forced): rank 0 chooses each step's tokens and broadcasts
    them; a worker that fed anything else would compute other keys, and later tokens would differ."""
    from tests.harness import set_policy

    one, two = paged_pair
    runner = two._engine.executor.runner
    launched = []
    original = runner.launch_decodes

    def counting(step: Any, k: int, *args: Any, **kw: Any) -> Any:
        launched.append(k)
        return original(step, k, *args, **kw)

    runner.launch_decodes = counting
    set_policy(two._engine, decode_steps=4, launch_first=True)
    try:
        batch = prompts(4, 4, 8, 30, two.spec.vocab_size)
        handles = [two.submit(p, max_new_tokens=14, temperature=0) for p in batch]
        got = [h.result().tokens for h in handles]
    finally:
        set_policy(two._engine, decode_steps=1, launch_first=False)
        del runner.launch_decodes
    assert launched and max(launched) == 4
    assert got == [greedy(one, p, n=14, reuse=False).tokens for p in batch]
    check_pool(two)


@pytest.mark.parametrize("pair", ["tiny_pair", "paged_pair"])
def test_tp2_session_reuses_its_prefix_and_equals_a_fresh_run(pair: str, request: pytest.FixtureRequest):
    """A decoder per request and the paged runner alike: turn 2 reuses turn 1 and equals a fresh run and one
    process; a rewind (on the paged pool its first page partly shared: a copy of 5 positions) on every rank."""
    one, two = request.getfixturevalue(pair)
    s = two.session()
    r1 = greedy(s, PROMPT)
    turn2 = PROMPT + r1.tokens + [70, 71, 72]
    r2 = greedy(s, turn2)
    assert r2.stats.reused_tokens == len(PROMPT) + len(r1.tokens) - 1
    same(r2, greedy(two, turn2, reuse=False))
    same(r2, greedy(one, turn2, reuse=False))
    back = greedy(s, PROMPT[:6])
    assert back.stats.reused_tokens == 5
    same(back, greedy(one, PROMPT[:6], reuse=False))
    s.close()
    if two.paged:
        check_pool(two)


def test_tp2_paged_prefix_shared_under_one_salt(paged_pair):
    one, two = paged_pair
    system = prompts(2, 1, 40, 41, two.spec.vocab_size)[0]  # 2 full pages and 8 positions of a third
    a, b = system + [11, 12, 13], system + [21, 22]
    ra = greedy(two.session(salt="team"), a)
    rb = greedy(two.session(salt="team"), b)
    assert ra.stats.reused_tokens == 0 and rb.stats.reused_tokens == len(system)
    other = greedy(two.session(salt="another-tenant"), b)
    assert other.stats.reused_tokens == 0, "another salt shares nothing"
    for got, prompt in ((ra, a), (rb, b), (other, b)):
        same(got, greedy(one, prompt, reuse=False))
    check_pool(two)


def test_tp2_paged_pool_pressure_preempts_and_every_result_is_right(paged_pair):
    one, two = paged_pair
    # 8 requests of 40-60 + 12 tokens (4-5 pages each) over 32 pages: some wait, running ones are preempted
    batch = prompts(3, 8, 40, 60, two.spec.vocab_size)
    before = two.kv_stats()["preemptions"]
    for got, p in zip(concurrent(two, batch, 12), batch, strict=True):
        same(got, greedy(one, p, reuse=False))
    assert two.kv_stats()["preemptions"] > before, "the pool was meant to run out while requests decode"
    check_pool(two)


def test_tp2_paged_saved_sessions_move_between_tp2_and_one_process(paged_pair, tmp_path: Path):
    """A session file written at TP=2 holds the whole cache (every rank's heads gathered): the single-process
    model continues it; one written by the single process is split into every rank's pool on restore. Each
    under a salt of its own, so no indexed page stands in for the restored KV."""
    one, two = paged_pair
    turn2 = None
    for src, dst, salt in ((two, one, "from-tp2"), (one, two, "from-one")):
        s = src.session(salt=salt)
        r1 = greedy(s, PROMPT)
        path = tmp_path / f"{salt}.kv"
        s.save(path)
        s.close()
        back = dst.restore_session(path, salt=salt)
        turn2 = PROMPT + r1.tokens + [70, 71]
        r2 = greedy(back, turn2)
        assert r2.stats.reused_tokens == len(PROMPT) + len(r1.tokens) - 1
        same(r2, greedy(one, turn2, reuse=False))
        back.close()
    assert turn2 is not None
    check_pool(two)


@pytest.mark.parametrize("paged", [False, True])
def test_closing_the_model_ends_its_workers(tiny_dir: Path, paged: bool):
    before = {p.pid for p in tp_children()}
    model = onnxgen.load(str(tiny_dir), backend="native", tensor_parallel=2, paged=paged)
    assert model.paged is paged
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
    before = {p.pid for p in tp_children()}
    with pytest.raises(BackendUnavailable, match="host KV tier"):
        onnxgen.load(str(tiny_dir), backend="native", tensor_parallel=2, host_kv_bytes=1 << 20)
    assert {p.pid for p in tp_children()} <= before


def test_tp2_default_model_greedy_equals_one_process(smollm2_dir: Path):
    """The builder-made default model: 9 query heads in 3 KV groups, split unevenly (1 + 2 groups); paged, as
    tensor parallelism loads by default (each rank's pool of its heads, the same pages)."""
    one = onnxgen.load(str(smollm2_dir), backend="native", paged=False)
    two = onnxgen.load(str(smollm2_dir), backend="native", tensor_parallel=2)
    assert two.paged
    try:
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        a, b = greedy(one, msgs, n=16), greedy(two, msgs, n=16)
        assert b.tokens == a.tokens
        assert abs(b.logits - a.logits).max() <= 1e-3 * abs(a.logits).max()
    finally:
        two.close()


def test_tp2_default_int4_model_greedy_equals_one_process():
    """The project's default model (int4 MatMulNBits, block 32, no zero points; 9 heads of 64 in 3 groups, so
    the output projection splits at block 6 of 18 and the down projection 24 + 24 of 48): paged, the same
    options in one process and over 2 ranks."""
    from onnxgen.convert.default import resolve_model_path

    path = str(resolve_model_path("default"))
    one = onnxgen.load(path, backend="native")
    two = onnxgen.load(path, backend="native", tensor_parallel=2)
    assert one.paged and two.paged
    try:
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        for prompt in (msgs, PROMPT):
            a, b = greedy(one, prompt, n=16), greedy(two, prompt, n=16)
            assert b.tokens == a.tokens
            assert abs(b.logits - a.logits).max() <= 1e-3 * abs(a.logits).max()
    finally:
        two.close()
        one.close()


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


def test_two_cuts_of_one_constant_get_two_names() -> None:
    """A rank's copies of an initializer cut two ways (e.g. read by two sharded nodes) do not overwrite each
    other."""
    from types import SimpleNamespace

    import torch

    from onnxgen.backends.native.tp.shard import Sharder, _Pass

    consts = {"w": torch.arange(12.0).reshape(3, 4)}
    p = _Pass(Sharder(rank=1, world=2, comm=None), [], consts, SimpleNamespace(head_size=4))
    a = p.put("w", consts["w"][:, :2])
    b = p.put("w", consts["w"][:, 2:])
    assert a != b and a != "w" and b != "w"
    assert torch.equal(consts[a], torch.tensor([[0.0, 1], [4, 5], [8, 9]]))
    assert torch.equal(consts[b], torch.tensor([[2.0, 3], [6, 7], [10, 11]]))
