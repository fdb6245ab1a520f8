"""CPU products over float32 weights laid out at load (`kernels.cpu_gemm`): prepacked for oneDNN (a few rows
through oneDNN, a longer chunk through MKL) and split into column blocks (one batched product, or a GEMM per
block) against a float64 product; one row exactly torch's `x @ w`; the lowering's packed copies and split
weights, and the logits they give against a program lowered without them."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from onnxgen.backends.native.kernels import cpu_gemm  # noqa: E402

needs_onednn = pytest.mark.skipif(not cpu_gemm.available(), reason="this torch build has no oneDNN linear")


@pytest.fixture(autouse=True)
def _prepack_on(monkeypatch: pytest.MonkeyPatch):
    """Prepacking is opt-in (`ONNXGEN_CPU_PREPACK=1`): on for this module unless a test turns it off. The C
    kernels (`kernels/cpu`, tested in test_cpu_kernels.py) are off here: they take the decode-size products
    these layouts serve otherwise."""
    from onnxgen.backends.native.kernels.cpu import build

    monkeypatch.setenv("ONNXGEN_CPU_PREPACK", "1")
    monkeypatch.setenv("ONNXGEN_CPU_KERNELS", "0")
    build.library.cache_clear()
    yield
    monkeypatch.undo()
    build.library.cache_clear()


@needs_onednn
@pytest.mark.parametrize("rows", [2, 5, 8, 16, 33])
@pytest.mark.parametrize(("k", "n"), [(64, 96), (576, 960), (96, 1000)])
def test_rows_over_the_packed_weight_equal_a_float64_product(rows: int, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(rows * k + n)
    w = torch.randn(k, n, generator=g)
    x = torch.randn(1, rows, k, generator=g)
    packed = cpu_gemm.prepack(w)
    assert packed is not None
    got = cpu_gemm.product(x, w, packed)
    want = x.double() @ w.double()
    assert got.shape == (1, rows, n) and got.dtype == torch.float32
    assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())


@needs_onednn
def test_one_row_is_torchs_product_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(128, 300, generator=g)
    x = torch.randn(1, 1, 128, generator=g)
    assert torch.equal(cpu_gemm.product(x, w, cpu_gemm.prepack(w)), torch.matmul(x, w))


@needs_onednn
def test_nothing_is_packed_for_other_dtypes_or_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(32, 48)
    assert cpu_gemm.prepack(w.bfloat16()) is None
    monkeypatch.setenv("ONNXGEN_CPU_PREPACK", "0")
    assert cpu_gemm.prepack(w) is None
    x = torch.randn(4, 32)
    assert torch.equal(cpu_gemm.product(x, w, None), x @ w)


def _last_logits(program, spec, tokens: list[int], pos0: int, kv) -> torch.Tensor:
    """One forward of `tokens` at `pos0` as `NativeDecoder._run_eager` runs it: the last position's logits."""
    from onnxgen.backends.native.ops import RunCtx

    env = program.new_env()
    s = len(tokens)
    env[program.input_slots[spec.input_ids_name]] = torch.tensor([tokens])
    kv.reserve(pos0 + s)
    positions = torch.arange(pos0, pos0 + s)
    if spec.position_ids_name in program.input_slots:
        env[program.input_slots[spec.position_ids_name]] = positions.view(1, s)
    if spec.attention_mask_name in program.input_slots:
        env[program.input_slots[spec.attention_mask_name]] = torch.ones((1, pos0 + s), dtype=torch.int64)
    out = program.execute(env, RunCtx(kv, pos0, s, positions))
    kv.set_length(pos0 + s)
    return out.reshape(-1, out.shape[-1])[-1].float()


@needs_onednn
def test_lowered_products_read_packed_weights_and_give_the_unpacked_logits(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny fp32 package lowered twice: with packed copies (every float32 product holds one) and without;
    a prefill chunk's logits (several rows through oneDNN) agree, and a decode step over the same KV gives
    the same bits."""
    from onnxgen.backends.native.lowering import lower
    from onnxgen.kv.buffers import KVBuffers
    from onnxgen.package.spec import load_spec

    spec = load_spec(tiny_dir)
    cpu = torch.device("cpu")
    on = lower(spec.decoder_path, spec, cpu)
    monkeypatch.setenv("ONNXGEN_CPU_PREPACK", "0")
    off = lower(spec.decoder_path, spec, cpu)
    packed = [st.node for st in on.steps if st.node.op in ("Linear", "RmsLinear", "LinearSiluMul")]
    assert packed and all(n.attr("_packed") is not None for n in packed)
    assert not any(st.node.attr("_packed") is not None for st in off.steps)

    ids = [5, 17, 3, 42, 9, 11, 60]
    kvs = [
        KVBuffers(spec.num_layers, spec.num_kv_heads, spec.head_size, torch.float32, cpu) for _ in range(2)
    ]
    a, b = _last_logits(on, spec, ids, 0, kvs[0]), _last_logits(off, spec, ids, 0, kvs[1])
    assert float((a - b).norm() / b.norm()) < 1e-5 and int(a.argmax()) == int(b.argmax())
    _last_logits(off, spec, ids, 0, kvs[0])  # the same KV on both sides, then one decode step each
    nxt = [int(a.argmax())]
    assert torch.equal(_last_logits(on, spec, nxt, 7, kvs[0]), _last_logits(off, spec, nxt, 7, kvs[1]))


@pytest.mark.parametrize("rows", [1, 5, cpu_gemm.SPLIT_ROWS + 8])
@pytest.mark.parametrize(("k", "n", "parts"), [(64, 96, 2), (576, 960, 2), (96, 999, 3)])
def test_products_over_split_weights_equal_a_float64_product(rows: int, k: int, n: int, parts: int) -> None:
    """One batched product over the blocks (up to SPLIT_ROWS rows) and a GEMM per block (more): the columns
    come back in their order."""
    g = torch.Generator().manual_seed(rows * k + n)
    w = torch.randn(k, n, generator=g)
    x = torch.randn(1, rows, k, generator=g)
    blocks = cpu_gemm.split(w, parts)
    assert blocks is not None and blocks.shape == (parts, k, n // parts) and blocks.is_contiguous()
    assert cpu_gemm.out_features(blocks) == n == cpu_gemm.out_features(w)
    got = cpu_gemm.product(x, blocks, None)
    want = x.double() @ w.double()
    assert got.shape == (1, rows, n) and got.dtype == torch.float32
    assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_weights_that_cannot_be_split_stay_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(32, 48)
    assert cpu_gemm.split(w, 1) is None  # one thread: nothing to share out
    assert cpu_gemm.split(w, 5) is None  # 48 columns do not cut into 5 blocks
    assert cpu_gemm.split(w.bfloat16(), 2) is None
    assert torch.equal(cpu_gemm.split(w, 2)[1], w[:, 24:])
    monkeypatch.setenv("ONNXGEN_CPU_SPLIT", "0")
    assert cpu_gemm.split_parts() == 1
    monkeypatch.setenv("ONNXGEN_CPU_SPLIT", "1")
    assert cpu_gemm.split_parts() == torch.get_num_threads()


def test_lowered_weights_split_where_products_alone_read_them(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny fp32 package lowered with its product weights split in 2 blocks and lowered whole: every
    product's weight is split, the embedding table (read by a Gather) is not, and a prefill chunk's and a
    decode step's logits agree."""
    from onnxgen.backends.native.lowering import lower
    from onnxgen.kv.buffers import KVBuffers
    from onnxgen.package.spec import load_spec

    spec = load_spec(tiny_dir)
    cpu = torch.device("cpu")
    monkeypatch.setenv("ONNXGEN_CPU_PREPACK", "0")
    monkeypatch.setattr(cpu_gemm, "split_parts", lambda: 2)
    on = lower(spec.decoder_path, spec, cpu)
    monkeypatch.setattr(cpu_gemm, "split_parts", lambda: 1)
    off = lower(spec.decoder_path, spec, cpu)
    products = [st for st in on.steps if st.node.op in ("Linear", "RmsLinear", "LinearSiluMul")]
    weight_at = {"Linear": 1, "LinearSiluMul": 1, "RmsLinear": 3}
    assert products and all(on.consts[st.ins[weight_at[st.node.op]]].dim() == 3 for st in products)
    assert not any(t.dim() == 3 for t in off.consts.values())
    gather = next(st for st in on.steps if st.node.op == "Gather")
    assert on.consts[gather.ins[0]].dim() == 2

    kvs = [
        KVBuffers(spec.num_layers, spec.num_kv_heads, spec.head_size, torch.float32, cpu) for _ in range(2)
    ]
    prompt = [5, 17, 3, 42, 9, 11, 60]
    a, b = _last_logits(on, spec, prompt, 0, kvs[0]), _last_logits(off, spec, prompt, 0, kvs[1])
    assert float((a - b).norm() / b.norm()) < 1e-5 and int(a.argmax()) == int(b.argmax())
    nxt = [int(b.argmax())]
    a, b = _last_logits(on, spec, nxt, len(prompt), kvs[0]), _last_logits(off, spec, nxt, len(prompt), kvs[1])
    assert float((a - b).norm() / b.norm()) < 1e-5 and int(a.argmax()) == int(b.argmax())
