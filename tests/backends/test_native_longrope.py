"""LongRoPE on the native backend: the builder's `If` between short and long rotary tables, lowered, and its
switch on both native paths (the contiguous decoder, the paged runner and engine), against the ort backend.

The package is the tiny synthetic GroupQueryAttention one with its rotary tables put behind the builder's
`If(attention_mask.shape[1] > 64)` (short tables of 64 rows, long ones of the whole context, as onnxruntime-
genai's builder writes Phi-3.5 / Phi-4-mini): onnxruntime runs the `If` itself, and the ort backend's
recompute at the switch is checked against transformers by the coverage matrix
(`tests/parity/test_builder_matrix.py`). The long tables here differ a lot from the short ones, so keys of the
wrong regime show in the logits."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

from onnxgen.backends.batch import BatchStep, SeqChunk  # noqa: E402
from onnxgen.backends.native.decoder import NativeDecoder  # noqa: E402
from onnxgen.backends.native.ops import builder  # noqa: E402
from onnxgen.backends.native.ops.base import INTERNAL, Node, RunCtx  # noqa: E402
from onnxgen.backends.native.runner import NativeRunner  # noqa: E402
from onnxgen.backends.ort.decoder import OrtDecoder  # noqa: E402
from onnxgen.errors import UnsupportedOp  # noqa: E402
from onnxgen.package.spec import load_spec  # noqa: E402

SWITCH = 64
TOL = 1e-5


def longrope_package(src: Path, dest: Path, *, cond: str = "Greater", branch: str = "constant") -> Path:
    """A copy of the synthetic package `src` (any attention style with `cos_cache` / `sin_cache` tables of
    half width) whose rotary tables sit behind the builder's LongRoPE `If`.
    `cond`: "Greater" (the builder's `mask length > 64`) or "Less" (`64 < mask length`: the same choice in a
    form the LongRoPE rewrite does not take). `branch`: "constant", or "runtime" (the then-branch reads a
    value of the outer graph)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    shutil.copytree(src, dest)
    model = onnx.load(str(dest / "model.onnx"), load_external_data=False)
    g = model.graph
    cos = numpy_helper.to_array(next(i for i in g.initializer if i.name == "cos_cache"), str(dest))
    rows, half = cos.shape
    for name in ("cos_cache", "sin_cache"):
        g.initializer.remove(next(i for i in g.initializer if i.name == name))
    # long tables: other frequencies and a scale, as LongRoPE's long factors and attention factor
    inv = 1.0 / (40.0 ** (np.arange(half, dtype=np.float64) / half))
    ang = np.arange(rows)[:, None] * inv[None, :]
    long_cos, long_sin = (1.3 * np.cos(ang)).astype(np.float32), (1.3 * np.sin(ang)).astype(np.float32)
    short_ang = np.arange(SWITCH)[:, None] * (1.0 / (10000.0 ** (np.arange(half) / half)))[None, :]
    short_cos, short_sin = np.cos(short_ang).astype(np.float32), np.sin(short_ang).astype(np.float32)

    def table(name: str, value: np.ndarray) -> Any:
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name))

    then_nodes = [table("cos_cache_large", long_cos), table("sin_cache_large", long_sin)]
    if branch == "runtime":  # the long cosines scaled by a value the graph computes at run time
        then_nodes[0].output[0] = "cos_cache_base"
        then_nodes.append(
            helper.make_node(
                "Mul", ["cos_cache_base", "/model/longrope/scale"], ["cos_cache_large"], name="scale_it"
            )
        )
    out = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
        for n in ("cos_cache_large", "sin_cache_large")
    ]
    then_g = helper.make_graph(then_nodes, "then", [], out)
    else_out = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
        for n in ("cos_cache_small", "sin_cache_small")
    ]
    else_g = helper.make_graph(
        [table("cos_cache_small", short_cos), table("sin_cache_small", short_sin)], "else", [], else_out
    )
    # the mask's length, as the builder computes it: Gather(Shape(attention_mask), 1)
    length = "/model/longrope/length"
    one = numpy_helper.from_array(np.array(1, dtype=np.int64))
    nodes = [
        helper.make_node("Shape", ["attention_mask"], ["/model/longrope/shape"]),
        helper.make_node("Constant", [], ["/model/longrope/one"], value=one),
        helper.make_node("Gather", ["/model/longrope/shape", "/model/longrope/one"], [length], axis=0),
        helper.make_node(
            "Constant", [], ["/model/longrope/switch"], value=numpy_helper.from_array(np.array(SWITCH))
        ),
    ]
    if cond == "Greater":
        nodes.append(
            helper.make_node("Greater", [length, "/model/longrope/switch"], ["/model/longrope/cond"])
        )
    else:
        nodes.append(helper.make_node("Less", ["/model/longrope/switch", length], ["/model/longrope/cond"]))
    nodes.append(helper.make_node("Cast", [length], ["/model/longrope/scale"], to=TensorProto.FLOAT))
    nodes.append(
        helper.make_node(
            "If",
            ["/model/longrope/cond"],
            ["cos_cache", "sin_cache"],
            name="/model/rope_caches_subgraph/If",
            then_branch=then_g,
            else_branch=else_g,
        )
    )
    for i, n in enumerate(nodes):
        g.node.insert(i, n)
    onnx.save(model, str(dest / "model.onnx"))
    return dest


@pytest.fixture(scope="module")
def pkg(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return longrope_package(tiny_dir, tmp_path_factory.mktemp("longrope") / "pkg")


@pytest.fixture(scope="module")
def spec(pkg: Path) -> Any:
    return load_spec(pkg)


def _ids(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, 380, n).tolist()


def _np(x: Any) -> np.ndarray:
    return (
        x.detach().float().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float32)
    )


def _close(a: Any, b: Any, tol: float = TOL) -> None:
    a, b = _np(a).reshape(-1), _np(b).reshape(-1)
    assert float(np.abs(a - b).max()) <= tol * max(1.0, float(np.abs(b).max()))


# --- the If, lowered --------------------------------------------------------------------------------------


def test_the_builders_if_becomes_one_table_read_at_each_tokens_row(spec: Any, tiny_dir: Path) -> None:
    """Nothing reads the attention mask any more: static steps and batching stay available, and every prompt
    length on both sides of the switch gives onnxruntime's logits."""
    dec = NativeDecoder(spec)
    p = dec.program
    assert p.rope_switch == SWITCH and p.static_ok and not p.uses_attention_mask
    assert not any("If" in op for op in p.info["ops"])
    ref = OrtDecoder(spec, threads=1)
    ids = _ids(100)
    for n in (10, SWITCH, SWITCH + 1, 100):
        _close(dec.forward(ids[:n], 0), ref.forward(ids[:n], 0))
        dec.reset()
        ref.reset()
    # the short tables are the original package's: the same logits below the switch, other ones past it
    plain = NativeDecoder(load_spec(tiny_dir))
    _close(plain.forward(ids[:10], 0), dec.forward(ids[:10], 0), 1e-4)
    plain.reset()
    dec.reset()
    far = _np(plain.forward(ids[: SWITCH + 1], 0)) - _np(dec.forward(ids[: SWITCH + 1], 0))
    assert float(np.abs(far).max()) > 0.1


def test_an_if_branch_reading_a_run_time_value_is_rejected_clearly(tiny_dir: Path, tmp_path: Path) -> None:
    bad = longrope_package(tiny_dir, tmp_path / "pkg", branch="runtime")
    with pytest.raises(UnsupportedOp) as info:
        NativeDecoder(load_spec(bad))
    msg = str(info.value)
    assert (
        "then_branch is not constant" in msg and "'scale_it' (Mul)" in msg and "/model/longrope/scale" in msg
    )
    assert info.value.node == "/model/rope_caches_subgraph/If"


def test_other_constant_ifs_choose_at_run_time(tiny_dir: Path, tmp_path: Path) -> None:
    """An `If` of constant branches in another form stays an `IfConst`: it reads the mask (eager steps only,
    no batching) and picks its branch by the condition computed at run time."""
    other = load_spec(longrope_package(tiny_dir, tmp_path / "pkg", cond="Less"))
    dec = NativeDecoder(other, static_steps=True)
    p = dec.program
    assert p.rope_switch is None and p.uses_attention_mask and not p.static_ok
    assert "onnxgen::IfConst" in p.info["ops"]
    ref = OrtDecoder(other, threads=1)
    ids = _ids(100, 3)
    for n in (10, 100):
        _close(dec.forward(ids[:n], 0), ref.forward(ids[:n], 0))
        dec.reset()
        ref.reset()


def test_rotary_embedding_ops_read_the_switched_tables(tmp_path: Path) -> None:
    """The opset-23 graph style (RotaryEmbedding with position ids, Attention, KV concatenated in the graph):
    its RotaryEmbedding ops read the one table at each token's row too, eager steps only (the KV concat)."""
    from onnxgen.convert.synthetic import SyntheticConfig, write_package

    cfg = SyntheticConfig(num_layers=2, context_length=1024, attention="onnx23")
    src = write_package(tmp_path / "onnx23", cfg)
    spec23 = load_spec(longrope_package(src, tmp_path / "pkg"))
    dec = NativeDecoder(spec23)
    assert dec.program.rope_switch == SWITCH and "RotaryEmbedding" in dec.program.info["ops"]
    ref = OrtDecoder(spec23, threads=1)
    ids = _ids(80, 14)
    _close(dec.forward(ids[:60], 0), ref.forward(ids[:60], 0))
    for i, t in enumerate(ids[60:68]):
        _close(dec.forward([t], 60 + i), ref.forward([t], 60 + i))
    assert dec.info["rope_recomputes"] == 1


def test_if_const_picks_by_a_host_condition_and_selects_same_shaped_values() -> None:
    node = Node("IfConst", INTERNAL, "if", ["c", "a", "b"], ["y"])
    fn = builder(node)(node)
    a, b = torch.zeros(3), torch.ones(3)
    assert fn(None, torch.tensor(True), a, b)[0] is a
    assert fn(None, torch.tensor([False]), a, b)[0] is b


# --- the contiguous decoder ---------------------------------------------------------------------------------


@pytest.mark.parametrize("static", [False, True])
def test_decoder_recomputes_at_the_switch_and_splits_rows_across_it(spec: Any, static: bool) -> None:
    """One-token steps across the switch, a verify step across it (rows in their own regimes), and a rewind
    back below it: each equal to onnxruntime's (which recomputes at the switch, as transformers' Phi-3) and to
    a fresh run. `static`: the steps CUDA graphs capture (lengths read on the device), run eagerly."""
    ids = _ids(80, 1)
    ref = OrtDecoder(spec, threads=1)
    dec = NativeDecoder(spec, static_steps=static, kv_floor=16)
    _close(dec.forward(ids[:56], 0), ref.forward(ids[:56], 0))
    steps = []
    for i, t in enumerate(ids[56:72]):
        steps.append(_np(dec.forward([t], 56 + i)))
        _close(steps[-1], ref.forward([t], 56 + i))
    assert dec.info["rope_recomputes"] == 1 and dec.info["rope_switch"] == SWITCH  # the step to 65 tokens
    if static:
        assert dec.info["static_forwards"].get(1, 0) >= 15

    dec = NativeDecoder(spec, static_steps=static, kv_floor=16)
    dec.forward(ids[:56], 0)
    rows = dec.forward(ids[56:72], 56, rows=16)  # one forward across the switch (a verify step)
    _close(rows, np.stack(steps))
    assert dec.info["rope_recomputes"] == 1 and dec.kv_len() == 72

    assert dec.rewind_to(50)
    again = dec.forward(ids[50:55], 50)  # 55 tokens: the short regime again
    _close(again, NativeDecoder(spec).forward(ids[:55], 0))
    assert dec.info["rope_recomputes"] == 2
    dec.reset()
    assert dec.forward(ids[:70], 0) is not None and dec.rewind_to(56)
    _close(dec.forward(ids[56:72], 56, rows=16), np.stack(steps))  # a long cache rewound below, then across


# --- the paged runner and engine ------------------------------------------------------------------------------


def test_runner_batches_sequences_on_both_sides_of_the_switch(spec: Any) -> None:
    """One ragged step: a decode past the switch, a decode below it, and the first chunk of a prompt longer
    than the switch (`SeqChunk.total`: its keys are long ones from position 0); each row equals onnxruntime's
    for that sequence alone, and the prompt's second chunk reads the first chunk's keys as long ones (a fresh
    run of the whole prompt)."""
    runner = NativeRunner(spec, kv_bytes=8 << 20)
    assert runner.rope_switch == SWITCH
    a, b, c = _ids(90, 4), _ids(30, 5), _ids(100, 6)
    pa, pb, pc = [0, 1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14]
    runner.run(BatchStep((SeqChunk(a[:70], 0, pa, 0), SeqChunk(b[:20], 0, pb, 0))))
    got = runner.run(
        BatchStep(
            (SeqChunk(a[70:71], 70, pa), SeqChunk(b[20:21], 20, pb), SeqChunk(c[:40], 0, pc, 0, total=100))
        )
    )
    ref = OrtDecoder(spec, threads=1)
    ref.forward(a[:70], 0)
    _close(got[0], ref.forward(a[70:71], 70))
    ref.reset()
    ref.forward(b[:20], 0)
    _close(got[1], ref.forward(b[20:21], 20))  # short: 21 tokens
    ref.reset()
    assert got.shape[0] == 2
    rest = runner.run(BatchStep((SeqChunk(c[40:], 40, pc, 1),)))
    _close(rest[0], ref.forward(c, 0))  # 100 tokens: every key in the long regime


def _engine_runs(
    pkg: Path, backend: str, prompts: list[list[int]], device: str = "cpu", **load: Any
) -> list[Any]:
    import onnxgen

    model = onnxgen.load(str(pkg), backend=backend, device=device, **load)
    try:
        handles = [model.submit(p, max_new_tokens=24, temperature=0, reuse=False) for p in prompts]
        return [h.result() for h in handles]
    finally:
        model.close()


@pytest.mark.parametrize(("steps", "chunk"), [(1, None), (4, 16)])
def test_paged_engine_across_the_switch_equals_the_ort_backend(
    pkg: Path, steps: int, chunk: int | None
) -> None:
    """Requests batched together on both sides of the switch, some crossing it while decoding (in runs of
    `steps` decode steps, none past the switch: the crossing step recomputes the request), with prompt-lookup
    drafts on a repetitive prompt (no verify step across the switch), prompts in chunks of `chunk` tokens (a
    long prompt's first chunks computed with the long factors already): the ort backend's greedy tokens."""
    loop = _ids(9, 7)
    prompts = [_ids(10, 8), _ids(50, 9), _ids(90, 10), (loop * 6)[:52]]
    want = _engine_runs(pkg, "ort", prompts)
    got = _engine_runs(pkg, "native", prompts, decode_steps=steps, chunk_size=chunk)
    for w, g in zip(want, got, strict=True):
        assert g.tokens == w.tokens
    assert got[3].stats.draft_tokens > 0


def test_paged_engine_logits_across_the_switch_and_a_session_past_it(pkg: Path) -> None:
    """Every step's logits of a request that crosses the switch while decoding, and a session whose turn 2
    crosses it and turn 3 stays past it (reusing turn 2): each equal to a fresh run (and to onnxruntime's)."""
    import onnxgen

    ids = _ids(120, 11)
    ref = onnxgen.load(str(pkg), backend="ort", device="cpu")
    model = onnxgen.load(str(pkg), backend="native", device="cpu")
    try:
        opts: dict[str, Any] = {"max_new_tokens": 20, "temperature": 0, "output_logits": True}
        r = model.generate(ids[:50], reuse=False, **opts)
        w = ref.generate(ids[:50], reuse=False, **opts)
        assert r.tokens == w.tokens
        _close(np.asarray(r.logits), np.asarray(w.logits))
        s = model.session()
        r1 = s.generate(ids[:40], max_new_tokens=8, temperature=0)
        turn = ids[:40] + r1.tokens + ids[40:70]
        for _ in range(2):
            r = s.generate(turn, **opts)
            fresh = model.session().generate(turn, **opts)
            assert r.tokens == fresh.tokens
            _close(np.asarray(r.logits), np.asarray(fresh.logits))
            _close(np.asarray(r.logits), np.asarray(ref.generate(turn, reuse=False, **opts).logits))
            last = r
            turn = turn + r.tokens + ids[70:80]
        assert last.stats.reused_tokens > 0
    finally:
        model.close()
        ref.close()


def test_rope_rows_need_totals_in_a_paged_step() -> None:
    from onnxgen.backends.native.ops.rotary import rope_rows

    pos = torch.arange(4)
    ctx = RunCtx(None, 2, 2, pos, totals=torch.tensor([10, 70, 70, 1]))
    assert rope_rows(ctx, (64, 100)).tolist() == [0, 101, 102, 3]
    assert rope_rows(RunCtx(None, 60, 4, pos), (64, 100)).tolist() == [0, 1, 2, 3]  # 64 tokens: short
    assert rope_rows(RunCtx(None, 62, 4, pos), (64, 100)).tolist() == [100, 101, 102, 103]  # 66: long
    assert rope_rows(ctx, None) is pos


# --- CUDA: the captured steps ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_graph_steps_across_the_switch_match_the_cpu(pkg: Path, spec: Any) -> None:
    """CUDA graphs read each sequence's length from device memory: decode graphs (and runs of them, the
    decode advance moving the lengths on) below and past the switch, prefill-chunk graphs of a prompt longer
    than the switch (its length set before the replay), verify graphs; the batch-1 decoder's captured steps
    too. Each equals the CPU path (fp32)."""
    loop = _ids(9, 7)
    prompts = [_ids(10, 8), _ids(50, 9), _ids(90, 10), _ids(60, 12), (loop * 6)[:52]]
    cpu = _engine_runs(pkg, "native", prompts, chunk_size=16)
    gpu = _engine_runs(pkg, "native", prompts, chunk_size=16, device="cuda", kv_bytes=64 << 20)
    for c, g in zip(cpu, gpu, strict=True):
        assert g.tokens == c.tokens
    import onnxgen

    model = onnxgen.load(str(pkg), backend="native", device="cuda", kv_bytes=64 << 20)
    on_cpu = onnxgen.load(str(pkg), backend="native", device="cpu")
    try:
        assert model.kv_stats()["cuda_graphs"]
        opts: dict[str, Any] = {"max_new_tokens": 20, "temperature": 0, "output_logits": True, "reuse": False}
        for n in (50, 90):
            g, c = model.generate(_ids(n, 13), **opts), on_cpu.generate(_ids(n, 13), **opts)
            assert g.tokens == c.tokens
            _close(np.asarray(g.logits), np.asarray(c.logits), 1e-4)
    finally:
        model.close()
        on_cpu.close()

    ids = _ids(80, 1)
    dev = NativeDecoder(spec, "cuda", kv_floor=16)
    ref = NativeDecoder(spec)
    _close(dev.forward(ids[:56], 0), ref.forward(ids[:56], 0), 1e-4)
    for i, t in enumerate(ids[56:72]):
        _close(dev.forward([t], 56 + i), ref.forward([t], 56 + i), 1e-4)
    assert dev.info["rope_recomputes"] == 1 and dev.info["static_forwards"].get(1, 0) >= 15
