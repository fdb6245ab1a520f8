"""The Triton few-row GEMM behind `kernels.linear.linear` (2..SKINNY_ROWS half-precision rows, and the fused
gate/up + SiLU) equals the float64 product: on the GPU (every configuration, and what `linear` picks), and on
the CPU under `TRITON_INTERPRET=1` where Triton is installed (skipped elsewhere)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the CPU runs Triton only under TRITON_INTERPRET=1", allow_module_level=True)

from onnxgen.backends.native.kernels import dispatch, gemv, linear  # noqa: E402

CONFIGS = gemv.SKINNY_CONFIGS if DEVICE == "cuda" else gemv.SKINNY_CONFIGS[:2]
# NOTE: the interpreter rounds float32 -> bf16 toward zero (the GPU rounds to nearest even)
TOL = 1e-2 if DEVICE == "cuda" else 4e-2


def _ref(x: torch.Tensor, w: torch.Tensor, silu: bool) -> torch.Tensor:
    y = x.double().cpu() @ w.double().cpu().T
    if not silu:
        return y
    n = w.shape[0] // 2
    g, u = y[..., :n].to(x.dtype).double(), y[..., n:].to(x.dtype).double()  # rounded, as the unfused path
    return g * torch.sigmoid(g) * u


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize(("m", "n", "k"), [(2, 96, 256), (5, 130, 520), (17, 64, 200), (64, 72, 136)])
def test_skinny_equals_float64_product(m: int, n: int, k: int, silu: bool, cfg: tuple) -> None:
    dispatch.build()
    g = torch.Generator().manual_seed(m + n + k)
    w = (torch.randn(2 * n if silu else n, k, generator=g) / k**0.5).to(torch.bfloat16).to(DEVICE)
    x = torch.randn(1, m, k, generator=g).to(torch.bfloat16).to(DEVICE)
    got = gemv.launch_skinny(x, w, silu, cfg)
    assert got.shape == (1, m, n) and got.dtype == torch.bfloat16
    want = _ref(x, w, silu)
    assert (got.cpu().double() - want).abs().max().item() <= TOL * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("silu", [False, True])
def test_linear_dispatch_of_a_few_rows_equals_float64_product(silu: bool) -> None:
    """`linear` on 3, 40 and 200 rows (the last past SKINNY_ROWS: cuBLAS), strided input rows included."""
    dispatch.build()
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(256 if silu else 128, 192, generator=g) / 14).to(torch.bfloat16).to(DEVICE)
    for rows in (3, 40, 200):
        wide = torch.randn(1, rows, 384, generator=g).to(torch.bfloat16).to(DEVICE)
        x = wide[..., :192]  # rows 384 apart: the kernel takes the row stride
        got = linear.linear(x, w, silu_halves=silu)
        want = _ref(x, w, silu)
        assert got.shape == (1, rows, w.shape[0] // (2 if silu else 1))
        assert (got.cpu().double() - want).abs().max().item() <= TOL * max(1.0, want.abs().max().item()), rows


@pytest.mark.parametrize("rows", [5, 40, 200])
def test_residual_is_added_before_the_one_rounding(rows: int) -> None:
    """The few-row GEMM with a residual (every configuration) equals `x @ w.T + r` in float64 to one rounding
    of the sum; the cuBLAS form (`linear_unfused`, and what `linear` runs past SKINNY_ROWS or where cuBLAS
    timed faster) is the rounded product plus r, rounded: the unfused ops' values, bit for bit."""
    dispatch.build()
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(72, 200, generator=g) / 14).to(torch.bfloat16).to(DEVICE)
    x = torch.randn(1, rows, 200, generator=g).to(torch.bfloat16).to(DEVICE)
    res = (4 * torch.randn(1, rows, 72, generator=g)).to(torch.bfloat16).to(DEVICE)
    want = _ref(x, w, False) + res.double().cpu()
    for cfg in CONFIGS if rows <= gemv.SKINNY_ROWS else ():
        got = gemv.launch_skinny(x, w, False, cfg, res)
        assert got.shape == (1, rows, 72) and got.dtype == torch.bfloat16
        err = (got.cpu().double() - want).abs()
        assert (err <= 2**-7 * want.abs() + 1e-6).all(), (
            cfg,
            err.max().item(),
        )  # one bf16 rounding of the sum
    unfused = (torch.nn.functional.linear(x, w).float() + res.float()).to(torch.bfloat16)
    assert torch.equal(linear.linear_unfused(x, w, residual=res), unfused)
    got = linear.linear(x, w, residual=res)  # whichever the dispatch takes: within two roundings
    prod = _ref(x, w, False).abs()
    err = (got.cpu().double() - want).abs()
    assert (err <= 2**-7 * (want.abs() + prod) + 1e-6).all(), err.max().item()
