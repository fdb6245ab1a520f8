"""The Triton int4 GEMV on packed MatMulNBits weights equals dequantize-then-MatMul (`ops.quant`): on the
GPU, and on the CPU under `TRITON_INTERPRET=1` where Triton is installed (skipped elsewhere)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from onnxgen.backends.native.ops.quant import dequant_matmul_nbits, kmajor  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the CPU runs Triton only under TRITON_INTERPRET=1", allow_module_level=True)

from onnxgen.backends.native.kernels.triton.int4 import int4_linear  # noqa: E402


def _weights(n: int, k: int, block: int, zp: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    nb = -(-k // block)
    packed = torch.randint(0, 256, (n, nb, block // 2), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n * nb, generator=g) * 0.02 + 0.001).to(torch.float32)
    if zp == "none":
        z = None
    elif zp == "packed":
        z = torch.randint(0, 256, (n, (nb + 1) // 2), generator=g, dtype=torch.uint8)
    else:
        z = torch.rand(n * nb, generator=g) * 15
    return packed, scales, z


@pytest.mark.parametrize("scheme", [1, 0])
@pytest.mark.parametrize(
    "tile", [(32, 64, 4), (16, 16, 4), (64, 8, 2), (8, 128, 4)]
)  # (columns, word rows per step, warps)
@pytest.mark.parametrize("zp", ["none", "packed", "float"])
@pytest.mark.parametrize(
    ("m", "n", "k", "block"), [(1, 96, 256, 32), (3, 40, 200, 32), (2, 64, 384, 128), (1, 64, 512, 16)]
)
def test_packed_gemv_equals_dequantize_then_matmul(
    zp: str, m: int, n: int, k: int, block: int, tile: tuple, scheme: int
) -> None:
    """`int4_linear` on `kmajor`'s tensors equals dequantize-then-MatMul in float64: within float32's
    error with `SCHEME=0` (each nibble at bits 19..22), within 1e-4 with `SCHEME=1` (nibbles read at bits
    12..15 as `1 + q / 2048` keep 13 bits of each product: the documented 4e-5, with room for short
    rows; `int4_linear` takes it for half-precision x only). Covers masked and unmasked (EVEN) loops, partial
    last blocks and N not a multiple of the tile."""
    packed, scales, z = _weights(n, k, block, zp)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    w = dequant_matmul_nbits(packed, scales, z, k, n, 4, block, torch.float32)  # [N, K]
    want = x.double() @ w.double().T
    words, st, zt = kmajor(
        packed.to(DEVICE), scales.to(DEVICE), None if z is None else z.to(DEVICE), k, n, block
    )
    got = int4_linear(x.to(DEVICE), words, st, zt, k, n, block, *tile, scheme=scheme).cpu()
    assert got.shape == (m, n)
    assert float((got.double() - want).norm() / want.norm()) < (1e-5 if scheme == 0 else 1e-4)


def test_packed_gemv_in_bf16_rounds_once() -> None:
    """bf16 x and scales (a bf16 package's decode step): each output is the float64 product rounded once
    (within half a bf16 step on the GPU; a whole step under the interpreter, which rounds toward zero)."""
    packed, scales, _ = _weights(128, 1024, 32, "none", seed=3)
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    sc = scales.to(torch.bfloat16)
    want = x.double() @ dequant_matmul_nbits(packed, sc, None, 1024, 128, 4, 32, torch.float64).T
    words, st, _ = kmajor(packed.to(DEVICE), sc.to(DEVICE), None, 1024, 128, 32)
    got = int4_linear(x.to(DEVICE), words, st, None, 1024, 128, 32).cpu()
    assert got.dtype == torch.bfloat16
    step = 2.0**-8 if DEVICE == "cuda" else 2.0**-7  # of |want|: half an ulp (nearest) or one (toward zero)
    assert bool(((got.double() - want).abs() <= want.abs() * step + 1e-6).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zp", ["none", "packed", "float"])
@pytest.mark.parametrize(("m", "n", "k", "tile"), [(1, 64, 256, (32, 64, 4)), (2, 40, 200, (16, 16, 4))])
def test_packed_gate_up_gemv_equals_the_two_products_then_silu_mul(
    zp: str, m: int, n: int, k: int, tile: tuple, dtype: torch.dtype
) -> None:
    """`silu=True` over a gate's and an up product's `kmajor` tensors side by side (`2 * N` columns, as the
    lowering's Int4LinearSiluMul holds them) equals the two packed products, each rounded to x's dtype,
    followed by `silu(g) * u` in float32 and one rounding: the unfused ops' values."""
    (pg, sg, zg), (pu, su, zu) = _weights(n, k, 32, zp, seed=4), _weights(n, k, 32, zp, seed=5)
    dev = [[None if t is None else t.to(DEVICE) for t in trio] for trio in ((pg, sg, zg), (pu, su, zu))]
    (wg, scg, ztg), (wu, scu, ztu) = (kmajor(*trio, k, n, 32) for trio in dev)
    if dtype != torch.float32:
        scg, scu = scg.to(dtype), scu.to(dtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6)).to(dtype).to(DEVICE)
    g = int4_linear(x, wg, scg, ztg, k, n, 32, *tile).float()
    u = int4_linear(x, wu, scu, ztu, k, n, 32, *tile).float()
    want = (torch.nn.functional.silu(g) * u).to(dtype)
    zp_both = None if ztg is None else torch.cat([ztg, ztu], dim=1)
    got = int4_linear(
        x, torch.cat([wg, wu], dim=1), torch.cat([scg, scu], dim=1), zp_both, k, n, 32, *tile, silu=True
    )
    assert got.shape == (m, n) and got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2.0**-7  # the same sums; bf16: one rounding step of exp's libm
    assert bool(((got.float() - want.float()).abs() <= want.float().abs() * tol + 1e-6).all())


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize(
    ("m", "n", "k", "tile", "zp"), [(1, 64, 256, (32, 64, 4), "none"), (2, 40, 200, (16, 16, 4), "packed")]
)
def test_packed_gemv_with_the_rms_norm_folded_in(
    m: int, n: int, k: int, tile: tuple, zp: str, skip: bool, silu: bool
) -> None:
    """`norm=(skip, weight, eps)` (the lowering's RmsInt4Linear) equals `kernels.reference.rms_norm_ref` followed by
    the packed product (and the gate/up SiLU): the residual sum bit for bit, the product within float32's
    error of the norm's output computed unrounded (float32 x here, so nothing is rounded either way)."""
    from onnxgen.backends.native.kernels.reference import rms_norm_ref

    cols = 2 * n if silu else n
    packed, scales, z = _weights(cols, k, 32, zp, seed=7)
    words, st, zt = kmajor(
        packed.to(DEVICE), scales.to(DEVICE), None if z is None else z.to(DEVICE), k, cols, 32
    )
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(m, k, generator=gen).to(DEVICE)
    s = torch.randn(m, k, generator=gen).to(DEVICE) if skip else None
    nw = (torch.rand(k, generator=gen) + 0.5).to(DEVICE)
    h, want_sum = rms_norm_ref(x, s, nw, 1e-5)
    want = int4_linear(h, words, st, zt, k, n, 32, *tile, silu=silu)
    got, got_sum = int4_linear(x, words, st, zt, k, n, 32, *tile, silu=silu, norm=(s, nw, 1e-5))
    assert (got_sum is None) == (not skip)
    if skip:
        assert torch.equal(got_sum, want_sum)
    assert float((got.double() - want.double()).norm() / want.double().norm()) < 1e-5


def test_packed_gemv_adds_a_residual_before_rounding() -> None:
    """`residual=` (the lowering's Int4Linear that forms a skip-norm's sum) equals the float32 product plus
    the residual, rounded once to x's dtype."""
    packed, scales, _ = _weights(64, 256, 32, "none", seed=9)
    words, st, _ = kmajor(packed.to(DEVICE), scales.to(DEVICE), None, 256, 64, 32)
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(2, 256, generator=gen).to(DEVICE)
    res = torch.randn(2, 64, generator=gen).to(DEVICE)
    plain = int4_linear(x, words, st, None, 256, 64, 32)
    got = int4_linear(x, words, st, None, 256, 64, 32, residual=res)
    torch.testing.assert_close(got, plain + res, rtol=1e-6, atol=1e-6)
    xb, rb = x.to(torch.bfloat16), res.to(torch.bfloat16)
    want = (int4_linear(xb.float(), words, st, None, 256, 64, 32) + rb.float()).to(torch.bfloat16)
    got = int4_linear(xb, words, st, None, 256, 64, 32, residual=rb)
    assert got.dtype == torch.bfloat16
    assert float((got.float() - want.float()).abs().max()) <= float(want.float().abs().max()) * 2.0**-7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zp", ["none", "packed", "float"])
@pytest.mark.parametrize(("n", "k", "block"), [(96, 256, 32), (40, 200, 32), (130, 384, 128), (64, 520, 16)])
def test_dequant_kernel_writes_the_dense_weight_k_major(
    zp: str, n: int, k: int, block: int, dtype: torch.dtype
) -> None:
    """`int4_dequant` (prefill rows' weight, one pass) gives `dequant_kmajor`'s values bit for bit, as
    `[K, N]`: partial last blocks, N and K not multiples of the tile, every zero-point form."""
    from onnxgen.backends.native.kernels.triton.int4 import int4_dequant
    from onnxgen.backends.native.ops.quant import dequant_kmajor

    packed, scales, z = _weights(n, k, block, zp, seed=n + k)
    words, st, zt = kmajor(
        packed.to(DEVICE), scales.to(dtype).to(DEVICE), None if z is None else z.to(DEVICE), k, n, block
    )
    got = int4_dequant(words, st, zt, k, n, block, dtype)
    w32 = dequant_kmajor(words, st, zt, k, n, block, torch.float32)  # float32 math, then one rounding
    if (
        DEVICE == "cpu" and dtype == torch.bfloat16
    ):  # the interpreter rounds toward zero (see test_gemv_kernel)
        w32 = (w32.view(torch.int32) & ~0xFFFF).view(torch.float32)
    assert got.shape == (k, n) and got.dtype == dtype
    assert torch.equal(got.cpu(), w32.to(dtype).T.cpu())


@pytest.mark.parametrize("silu", [False, True])
def test_rowwise_packed_products_give_every_row_its_one_row_bits(silu: bool) -> None:
    """A verify step's rows (`rowwise`) through `ops.quant.packed_product`: more rows than `GEMV_ROWS` still
    run the packed GEMV, each row the bits of the same row alone (a decode step's product) — without
    `rowwise` such a step dequantizes and multiplies, which need not round alike."""
    from onnxgen.backends.native.ops import quant

    n, k, block, rows = 48, 256, 32, quant.GEMV_ROWS + 4
    cols = 2 * n if silu else n
    packed, scales, z = _weights(cols, k, block, "packed", seed=4)
    words, st, zt = kmajor(packed.to(DEVICE), scales.to(DEVICE), z.to(DEVICE), k, cols, block)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.bfloat16)
    got = quant.packed_product(x, words, st.to(torch.bfloat16), zt, k, n, block, silu, rowwise=True)
    for i in range(rows):
        one = quant.packed_product(x[i : i + 1], words, st.to(torch.bfloat16), zt, k, n, block, silu)
        assert torch.equal(got[i : i + 1], one), i
