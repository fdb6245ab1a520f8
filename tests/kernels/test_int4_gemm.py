"""The Triton few-row GEMM on packed MatMulNBits weights (`kernels/triton/int4_gemm.py`) equals the dense
path it replaces, dequantize-then-matmul: on the GPU, and on the CPU under `TRITON_INTERPRET=1` where Triton
is installed (skipped elsewhere)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from onnxgen.backends.native.ops.quant import dequant_kmajor, dequant_matmul_nbits, kmajor  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the CPU runs Triton only under TRITON_INTERPRET=1", allow_module_level=True)

from onnxgen.backends.native.kernels.triton.int4_gemm import int4_gemm  # noqa: E402
from tests.kernels.test_int4_kernel import _weights  # noqa: E402


@pytest.mark.parametrize("zp", ["none", "packed", "float"])
@pytest.mark.parametrize(
    ("m", "n", "k", "block", "tile"),
    [
        (17, 96, 256, 32, (16, 64, 16, 4)),  # rows past one tile, the second tile mostly masked
        (40, 40, 200, 32, (32, 32, 16, 4)),  # N and K not multiples of the tile, a partial last block
        (64, 64, 384, 128, (64, 16, 32, 4)),
        (24, 48, 512, 16, (16, 16, 16, 2)),
    ],
)
def test_packed_gemm_equals_dequantize_then_matmul_in_float32(
    zp: str, m: int, n: int, k: int, block: int, tile: tuple
) -> None:
    """float32 x (IEEE products, no TF32): the float64 product of x and the dequantized weight within
    float32's error, for every row, masked tiles included."""
    packed, scales, z = _weights(n, k, block, zp)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    w = dequant_matmul_nbits(packed, scales, z, k, n, 4, block, torch.float32)  # [N, K]
    want = x.double() @ w.double().T
    words, st, zt = kmajor(
        packed.to(DEVICE), scales.to(DEVICE), None if z is None else z.to(DEVICE), k, n, block
    )
    bm, bn, bk8, warps = tile
    got = int4_gemm(x.to(DEVICE), words, st, zt, k, n, block, bm, bn, bk8, warps).cpu()
    assert got.shape == (m, n) and got.dtype == torch.float32
    rel = (got.double() - want).norm(dim=1) / want.norm(dim=1)
    assert float(rel.max()) < 1e-5


@pytest.mark.parametrize("zp", ["none", "packed", "float"])
def test_packed_gate_up_gemm_equals_silu_of_the_two_products(zp: str) -> None:
    """`silu=True` over a gate's and an up product's columns side by side (`2 * N`): float32 x gives
    `silu(x @ Wg.T) * (x @ Wu.T)` of the dequantized weights within float32's error."""
    k, n, block, m = 256, 48, 32, 21
    packed, scales, z = _weights(2 * n, k, block, zp, seed=4)
    words, st, zt = kmajor(
        packed.to(DEVICE), scales.to(DEVICE), None if z is None else z.to(DEVICE), k, 2 * n, block
    )
    w = dequant_kmajor(words, st, zt, k, 2 * n, block, torch.float32).cpu()  # [2N, K]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5))
    y = x.double() @ w.double().T
    want = torch.nn.functional.silu(y[:, :n]) * y[:, n:]
    got = int4_gemm(x.to(DEVICE), words, st, zt, k, n, block, silu=True).cpu()
    assert got.shape == (m, n)
    assert float(((got.double() - want).norm(dim=1) / want.norm(dim=1)).max()) < 1e-5


@pytest.mark.parametrize("silu", [False, True])
def test_packed_gemm_in_bf16_equals_the_dense_path(silu: bool) -> None:
    """bf16 x and scales (a bf16 package's batched decode step): the weight values are the dense path's
    (`dequant_kmajor` rounded once to bf16), so the result equals that weight's matmul rounded to bf16 (with
    `silu`: `silu(g) * u` of the halves each rounded first, then rounded) up to summation order: each row
    within the roundings' error — one bf16 step (2^-8 of a value, nearest; 2^-7 under the interpreter, which
    rounds toward zero) per rounding, two more with the SiLU's halves."""
    k, n, block, m = 512, 64, 32, 33
    cols = 2 * n if silu else n
    packed, scales, _ = _weights(cols, k, block, "none", seed=3)
    sc = scales.to(torch.bfloat16)
    words, st, _ = kmajor(packed.to(DEVICE), sc.to(DEVICE), None, k, cols, block)
    w = dequant_kmajor(words, st, None, k, cols, block, torch.bfloat16)  # [cols, K], the dense path's values
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEVICE)
    y = (x.float() @ w.float().T).to(torch.bfloat16).float()
    want = (torch.nn.functional.silu(y[:, :n]) * y[:, n:]).to(torch.bfloat16) if silu else y
    got = int4_gemm(x, words, st, None, k, n, block, silu=silu)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    d = (got.float() - want.float()).cpu()
    rel = d.norm(dim=1) / want.float().cpu().norm(dim=1)
    step = 2.0**-8 if DEVICE == "cuda" else 2.0**-7
    assert float(rel.max()) < step * (3 if silu else 1), rel


def test_packed_gemm_adds_a_residual_before_rounding() -> None:
    """`residual=`: the float32 product plus the residual, rounded once."""
    k, n, block, m = 256, 64, 32, 20
    packed, scales, _ = _weights(n, k, block, "none", seed=9)
    words, st, _ = kmajor(packed.to(DEVICE), scales.to(DEVICE), None, k, n, block)
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(m, k, generator=gen).to(DEVICE)
    r = torch.randn(m, n, generator=gen).to(DEVICE)
    base = int4_gemm(x, words, st, None, k, n, block)
    got = int4_gemm(x, words, st, None, k, n, block, residual=r)
    assert float((got - (base + r)).abs().max()) < 1e-5


@pytest.mark.parametrize("silu", [False, True])
def test_packed_product_runs_batches_through_the_gemm(silu: bool) -> None:
    """`ops.quant.packed_product` on more rows than `GEMV_ROWS` and at most `GEMM_ROWS`: the packed GEMM's
    values (the configuration `_int4_gemm_choice` takes, or the dense path where that timed faster), within
    the roundings of dequantize-then-matmul per row."""
    from onnxgen.backends.native.kernels.dispatch import use_triton
    from onnxgen.backends.native.ops import quant

    x0 = torch.zeros(1, device=DEVICE)
    if not use_triton(x0):
        pytest.skip("needs CUDA or ONNXGEN_FORCE_TRITON=1 under the interpreter")
    n, k, block = 48, 256, 32
    cols = 2 * n if silu else n
    packed, scales, z = _weights(cols, k, block, "packed", seed=11)
    words, st, zt = kmajor(packed.to(DEVICE), scales.to(DEVICE), z.to(DEVICE), k, cols, block)
    st = st.to(torch.bfloat16)
    for rows in (quant.GEMV_ROWS + 1, 64):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(DEVICE, torch.bfloat16)
        got = quant.packed_product(x, words, st, zt, k, n, block, silu)
        cfg = quant._int4_gemm_choice(x, words, st, zt, k, n, block, silu)
        if cfg is not None:
            assert torch.equal(got, int4_gemm(x, words, st, zt, k, n, block, *cfg, silu=silu))
        w = dequant_kmajor(words, st, zt, k, cols, block, torch.bfloat16).float()
        y = (x.float() @ w.T).to(torch.bfloat16).float()
        want = torch.nn.functional.silu(y[:, :n]) * y[:, n:] if silu else y
        rel = (got.float() - want).norm(dim=1) / want.norm(dim=1)
        step = 2.0**-8 if DEVICE == "cuda" else 2.0**-7  # the interpreter rounds toward zero
        assert float(rel.max()) < step * (
            4 if silu else 2
        )  # the weights' rounding, the output's (the halves')
