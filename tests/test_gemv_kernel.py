"""The Triton GEMV behind `kernels.linear` (one-row products, and the fused gate/up + SiLU) equals the float64
product: on the GPU (every configuration, and the one `linear` picks), and on the CPU under
`TRITON_INTERPRET=1` where Triton is installed (skipped elsewhere)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the CPU runs Triton only under TRITON_INTERPRET=1", allow_module_level=True)

from onnxgen.backends.native import kernels  # noqa: E402


def _ref(x: torch.Tensor, w: torch.Tensor, silu: bool) -> torch.Tensor:
    y = x.double() @ w.double().T
    if not silu:
        return y
    n = w.shape[0] // 2
    g, u = y[..., :n].to(x.dtype).double(), y[..., n:].to(x.dtype).double()  # rounded, as the unfused path
    return g * torch.sigmoid(g) * u


CONFIGS = kernels.GEMV_CONFIGS if DEVICE == "cuda" else kernels.GEMV_CONFIGS[:2]
# NOTE: the interpreter rounds float32 -> bf16 toward zero (the GPU rounds to nearest even): intermediates
# the kernel rounds on purpose (the normalised row, g and u) may then sit one bf16 step lower there
ROUNDED_TOL = 1e-2 if DEVICE == "cuda" else 4e-2


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize(("n", "k", "dtype"), [(40, 200, torch.float32), (96, 256, torch.bfloat16),
                                               (130, 520, torch.bfloat16)])  # fmt: skip
def test_gemv_equals_float64_product(n: int, k: int, dtype: torch.dtype, silu: bool, cfg: tuple) -> None:
    kernels._build()
    g = torch.Generator().manual_seed(n + k)
    rows = 2 * n if silu else n
    w = (torch.randn(rows, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    x = torch.randn(1, 1, k, generator=g).to(dtype).to(DEVICE)
    got = kernels._gemv(x, w, silu, cfg)
    assert got.shape == (1, 1, n) and got.dtype == dtype
    want = _ref(x, w, silu)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the output (and of g, u)
    assert (got.double() - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("silu", [False, True])
def test_linear_dispatch_equals_float64_product(silu: bool) -> None:
    """`linear` (one row: a GEMV where it was measured faster, else cuBLAS; several rows: cuBLAS and the
    in-place `silu_mul_halves`) equals the float64 product, and so does `linear_unfused`."""
    kernels._build()
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(256 if silu else 128, 192, generator=g) / 14).to(torch.bfloat16).to(DEVICE)
    for rows in (1, 3):
        x = torch.randn(1, rows, 192, generator=g).to(torch.bfloat16).to(DEVICE)
        want = _ref(x.cpu(), w.cpu(), silu)
        for got in (kernels.linear(x, w, silu_halves=silu), kernels.linear_unfused(x, w, silu)):
            assert got.shape == (1, rows, w.shape[0] // (2 if silu else 1))
            err = (got.cpu().double() - want).abs().max().item()
            assert err <= ROUNDED_TOL * max(1.0, want.abs().max().item()), (rows, err)


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("skip", [False, True])
def test_gemv_with_rms_norm_equals_norm_then_product(skip: bool, silu: bool) -> None:
    """`rms_linear`: the GEMV normalising its input (and writing the residual sum) equals `rms_norm_ref`
    followed by the float64 product of its rounded output."""
    kernels._build()
    g = torch.Generator().manual_seed(3)
    n, k, dtype = 72, 328, torch.bfloat16
    w = (torch.randn(2 * n if silu else n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    x = torch.randn(1, 1, k, generator=g).to(dtype).to(DEVICE)
    res = torch.randn(1, 1, k, generator=g).to(dtype).to(DEVICE) if skip else None
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
    s_ref = None
    for cfg in CONFIGS:
        got_s = torch.empty_like(x) if skip else None
        got = kernels._gemv(x, w, silu, cfg, (res, nw, 1e-5, got_s))
        h, s_ref = kernels.rms_norm_ref(x.cpu(), None if res is None else res.cpu(), nw.cpu(), 1e-5)
        want = _ref(h, w.cpu(), silu)
        assert (got.cpu().double() - want).abs().max().item() <= ROUNDED_TOL * max(1.0, want.abs().max().item())
        if skip and DEVICE == "cuda":  # the sum, rounded once: exactly the norm's
            assert torch.equal(got_s.cpu(), s_ref)
        elif skip:
            assert torch.allclose(got_s.cpu().float(), s_ref.float(), rtol=2**-7, atol=0)
    y, s = kernels.rms_linear(x, res, nw, 1e-5, w, silu)  # the dispatching entry point
    assert y.shape == (1, 1, n) and (s is None) == (not skip)
