"""The Triton GEMV behind `kernels.linear.linear` (one-row products, and the fused gate/up + SiLU) equals the float64
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

from onnxgen.backends.native.kernels import dispatch, gemv, linear  # noqa: E402
from onnxgen.backends.native.kernels.reference import rms_norm_ref  # noqa: E402


def _ref(x: torch.Tensor, w: torch.Tensor, silu: bool) -> torch.Tensor:
    y = x.double() @ w.double().T
    if not silu:
        return y
    n = w.shape[0] // 2
    g, u = y[..., :n].to(x.dtype).double(), y[..., n:].to(x.dtype).double()  # rounded, as the unfused path
    return g * torch.sigmoid(g) * u


CONFIGS = gemv.GEMV_CONFIGS if DEVICE == "cuda" else gemv.GEMV_CONFIGS[:2]
# NOTE: the interpreter rounds float32 -> bf16 toward zero (the GPU rounds to nearest even): intermediates
# the kernel rounds on purpose (the normalised row, g and u) may then sit one bf16 step lower there
ROUNDED_TOL = 1e-2 if DEVICE == "cuda" else 4e-2


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize(
    ("n", "k", "dtype"), [(40, 200, torch.float32), (96, 256, torch.bfloat16), (130, 520, torch.bfloat16)]
)
def test_gemv_equals_float64_product(n: int, k: int, dtype: torch.dtype, silu: bool, cfg: tuple) -> None:
    dispatch.build()
    g = torch.Generator().manual_seed(n + k)
    rows = 2 * n if silu else n
    w = (torch.randn(rows, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    x = torch.randn(1, 1, k, generator=g).to(dtype).to(DEVICE)
    got = gemv.launch_gemv(x, w, silu, cfg)
    assert got.shape == (1, 1, n) and got.dtype == dtype
    want = _ref(x, w, silu)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the output (and of g, u)
    assert (got.double() - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("silu", [False, True])
def test_linear_dispatch_equals_float64_product(silu: bool) -> None:
    """`linear` (one row: a GEMV where it was measured faster, else cuBLAS; several rows: cuBLAS and the
    in-place `silu_mul_halves`) equals the float64 product, and so does `linear_unfused`."""
    dispatch.build()
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(256 if silu else 128, 192, generator=g) / 14).to(torch.bfloat16).to(DEVICE)
    for rows in (1, 3):
        x = torch.randn(1, rows, 192, generator=g).to(torch.bfloat16).to(DEVICE)
        want = _ref(x.cpu(), w.cpu(), silu)
        for got in (linear.linear(x, w, silu_halves=silu), linear.linear_unfused(x, w, silu)):
            assert got.shape == (1, rows, w.shape[0] // (2 if silu else 1))
            err = (got.cpu().double() - want).abs().max().item()
            assert err <= ROUNDED_TOL * max(1.0, want.abs().max().item()), (rows, err)


def _late_ref(x: torch.Tensor, res: torch.Tensor | None, nw: torch.Tensor, eps: float) -> torch.Tensor:
    """The normalised row in float64, unrounded (what a `NORM_LATE` GEMV multiplies by, in effect)."""
    h = x.double() + (res.double() if res is not None else 0.0)
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * nw.double()


@pytest.mark.parametrize("late", [False, True], ids=["early", "late"])
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("skip", [False, True])
def test_gemv_with_rms_norm_equals_norm_then_product(
    skip: bool, silu: bool, late: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rms_linear`: the GEMV normalising its input (and writing the residual sum) equals `rms_norm_ref`
    followed by the float64 product of its rounded output; with `NORM_LATE` (the scale after the product)
    the float64 product of the unrounded normalised row, within one rounding of the output."""
    monkeypatch.setenv("ONNXGEN_NORM_LATE", "1" if late else "0")
    dispatch.build()
    g = torch.Generator().manual_seed(3)
    n, k, dtype = 72, 328, torch.bfloat16
    w = (torch.randn(2 * n if silu else n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    x = torch.randn(1, 1, k, generator=g).to(dtype).to(DEVICE)
    res = torch.randn(1, 1, k, generator=g).to(dtype).to(DEVICE) if skip else None
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
    s_ref = None
    for cfg in CONFIGS:
        got_s = torch.empty_like(x) if skip else None
        got = gemv.launch_gemv(x, w, silu, cfg, (res, nw, 1e-5, got_s))
        h, s_ref = rms_norm_ref(x.cpu(), None if res is None else res.cpu(), nw.cpu(), 1e-5)
        if late:
            want = _ref(
                _late_ref(x.cpu(), None if res is None else res.cpu(), nw.cpu(), 1e-5),
                w.cpu().double(),
                False,
            )
            if silu:
                gg, uu = want[..., :n].to(dtype).double(), want[..., n:].to(dtype).double()
                want = gg * torch.sigmoid(gg) * uu
        else:
            want = _ref(h, w.cpu(), silu)
        assert (got.cpu().double() - want).abs().max().item() <= ROUNDED_TOL * max(
            1.0, want.abs().max().item()
        )
        if skip and DEVICE == "cuda":  # the sum, rounded once: exactly the norm's
            assert torch.equal(got_s.cpu(), s_ref)
        elif skip:
            assert torch.allclose(got_s.cpu().float(), s_ref.float(), rtol=2**-7, atol=0)
    y, s = linear.rms_linear(x, res, nw, 1e-5, w, silu)  # the dispatching entry point
    assert y.shape == (1, 1, n) and (s is None) == (not skip)


class _KV:
    """KV buffers as `rope_qkv_write` and `linear_rope` take them: `keys[layer]` `[1, kv_heads, rows, d]`."""

    def __init__(self, hkv: int, rows: int, d: int, dtype: torch.dtype) -> None:
        self.keys = [torch.zeros(1, hkv, rows, d, dtype=dtype, device=DEVICE)]
        self.values = [torch.zeros(1, hkv, rows, d, dtype=dtype, device=DEVICE)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("half", [8, 4])  # full and partial rotary of 16-wide heads
@pytest.mark.parametrize("norm", [False, True, "late"])
def test_qkv_product_with_rotary_and_kv_write_equals_the_separate_ops(
    dtype: torch.dtype, half: int, norm: bool | str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kernels.linear.linear_rope` (QKV rows with adjacent rotation pairs): the product (normalised first with
    `norm`), q and k rotated by interleaved pairs at the token's position, k and v written at its slot —
    against torch: the float64 product rounded, `rotary.rope(interleaved=True)`, plain slot writes."""
    from onnxgen.backends.native.rotary import rope

    monkeypatch.setenv("ONNXGEN_NORM_LATE", "1" if norm == "late" else "0")
    n, hkv, d, k = 4, 2, 16, 64
    g = torch.Generator().manual_seed(half + 2 * bool(norm))
    x = torch.randn(1, 1, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn((n + 2 * hkv) * d, k, generator=g) / 8).to(DEVICE, dtype)
    ang = torch.arange(50.0)[:, None] * (0.7 ** torch.arange(half))[None, :]
    cos, sin = ang.cos().to(DEVICE, dtype), ang.sin().to(DEVICE, dtype)
    pos, slot = torch.tensor([37], device=DEVICE), torch.tensor([5], device=DEVICE)
    skip = torch.randn(1, 1, k, generator=g).to(DEVICE, dtype)
    nw = (1 + torch.randn(k, generator=g) / 4).to(DEVICE, dtype)
    kv = _KV(hkv, 8, d, dtype)
    out = linear.linear_rope(
        x, w, linear.Rope(cos, sin, pos, slot, kv, 0, n, hkv, d), (skip, nw, 1e-6) if norm else None
    )
    assert out is not None
    y, s = out
    h = (
        (_late_ref(x, skip, nw, 1e-6) if norm == "late" else rms_norm_ref(x, skip, nw, 1e-6)[0])
        if norm
        else x
    )
    want = (h.double() @ w.double().T).to(dtype).float().view(n + 2 * hkv, d)
    c, sn = cos[37].float().view(1, 1, half), sin[37].float().view(1, 1, half)
    qk = rope(want[: n + hkv].view(1, n + hkv, d), c, sn, True).view(n + hkv, d)
    tol = 1e-5 if dtype == torch.float32 else ROUNDED_TOL
    got = y.float().view(n + 2 * hkv, d)
    assert float((got[: n + hkv] - qk).norm() / qk.norm()) < tol
    assert torch.allclose(got[n + hkv :], want[n + hkv :], atol=tol)
    assert torch.equal(kv.keys[0][0, :, 5], y.view(n + 2 * hkv, d)[n : n + hkv])
    assert torch.equal(kv.values[0][0, :, 5], y.view(n + 2 * hkv, d)[n + hkv :])
    assert not kv.keys[0][0, :, :5].any() and not kv.keys[0][0, :, 6:].any(), "only the token's slot"
    if norm:
        assert torch.allclose(s.float(), (x.float() + skip.float()), atol=tol)


def _rows_case(
    seed: int, n: int, k: int, rows: int, dtype: torch.dtype, silu: bool
) -> tuple[torch.Tensor, ...]:
    """A weight (`[2n, K]` with `silu`), `rows` rows of x, a residual of the same shape and a norm weight."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(2 * n if silu else n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    x = torch.randn(1, rows, k, generator=g).to(dtype).to(DEVICE)
    res = torch.randn(1, rows, k, generator=g).to(dtype).to(DEVICE)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
    return w, x, res, nw


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("norm", [None, "plain", "skip", "late"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rowwise_rows_are_the_bits_of_one_row_launches(
    dtype: torch.dtype, norm: str | None, silu: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GEMV launch over several rows (a verify step's, `linear(..., rowwise=True)`) gives each row the
    same bits as a launch of that row alone, for every configuration, with the norm folded in (and its
    residual sum; `late`: scaled after the product) or not; the dispatching entry points agree with one-row
    calls too."""
    monkeypatch.setenv("ONNXGEN_NORM_LATE", "1" if norm == "late" else "0")
    dispatch.build()
    n, k, rows = 72, 328, 5
    w, x, res, nw = _rows_case(11, n, k, rows, dtype, silu)
    res = res if norm in ("skip", "late") else None
    for cfg in CONFIGS:
        sums = torch.empty_like(x) if res is not None else None
        got = gemv.launch_gemv(x, w, silu, cfg, None if norm is None else (res, nw, 1e-5, sums))
        for i in range(rows):
            s1 = torch.empty_like(x[:, i : i + 1]) if res is not None else None
            r1 = None if res is None else res[:, i : i + 1]
            one = gemv.launch_gemv(
                x[:, i : i + 1], w, silu, cfg, None if norm is None else (r1, nw, 1e-5, s1)
            )
            assert torch.equal(got[:, i], one[:, 0]), (cfg, i)
            if res is not None:
                assert torch.equal(sums[:, i], s1[:, 0])
    if norm is None:
        both = (
            linear.linear(x, w, silu, rowwise=True),
            [linear.linear(x[:, i : i + 1], w, silu) for i in range(rows)],
        )
    else:
        y, _ = linear.rms_linear(x, res, nw, 1e-5, w, silu, rowwise=True)
        both = (
            y,
            [
                linear.rms_linear(
                    x[:, i : i + 1], None if res is None else res[:, i : i + 1], nw, 1e-5, w, silu
                )[0]
                for i in range(rows)
            ],
        )
    for i in range(rows):
        assert torch.equal(both[0][:, i], both[1][i][:, 0]), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rowwise_qkv_rotary_rows_are_the_bits_of_one_row_launches(dtype: torch.dtype) -> None:
    """`linear_rope(..., rowwise=True)` over a verify step's rows (each its own position and slot) gives the
    rows, and writes the keys and values, that one-row calls at those positions give."""
    n, hkv, d, k, rows = 4, 2, 16, 64, 4
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, rows, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn((n + 2 * hkv) * d, k, generator=g) / 8).to(DEVICE, dtype)
    ang = torch.arange(50.0)[:, None] * (0.7 ** torch.arange(8))[None, :]
    cos, sin = ang.cos().to(DEVICE, dtype), ang.sin().to(DEVICE, dtype)
    pos, slot = torch.tensor([20, 21, 22, 23], device=DEVICE), torch.tensor([3, 4, 1, 6], device=DEVICE)
    skip = torch.randn(1, rows, k, generator=g).to(DEVICE, dtype)
    nw = (1 + torch.randn(k, generator=g) / 4).to(DEVICE, dtype)
    kv_all, kv_one = _KV(hkv, 8, d, dtype), _KV(hkv, 8, d, dtype)
    out = linear.linear_rope(
        x, w, linear.Rope(cos, sin, pos, slot, kv_all, 0, n, hkv, d), (skip, nw, 1e-6), rowwise=True
    )
    assert out is not None
    y, s = out
    for i in range(rows):
        one = linear.linear_rope(
            x[:, i : i + 1],
            w,
            linear.Rope(cos, sin, pos[i : i + 1], slot[i : i + 1], kv_one, 0, n, hkv, d),
            (skip[:, i : i + 1], nw, 1e-6),
        )
        assert one is not None
        assert torch.equal(y[:, i], one[0][:, 0]) and torch.equal(s[:, i], one[1][:, 0])
    assert torch.equal(kv_all.keys[0], kv_one.keys[0]) and torch.equal(kv_all.values[0], kv_one.values[0])


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("norm", [None, "late"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_x_loaded_in_the_weight_tile_gives_the_same_bits(
    dtype: torch.dtype, norm: str | None, silu: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`X2D` (`kernels.gemv.x_in_tile`: x loaded in the weight tile's shape, no conversion through shared memory)
    changes where x sits, not what is summed: every configuration gives the bits of the `[BLOCK_K]` load,
    over several K steps and a partial last one, with the residual sum. With a late norm the sum of squares
    is reduced in the layout x is loaded in, so on the GPU its float32 rstd (and so a float32 product) may
    differ in the last bits (seen on the H100, 2026-12-05): those products agree to 1e-6, the residual sums
    and the bf16 products to the bit. (What speculative decoding needs is that a verify row and a decode row
    take the same `X2D` decision, which is per configuration: `test_rowwise_*`.)"""
    monkeypatch.setenv("ONNXGEN_NORM_LATE", "1" if norm == "late" else "0")
    dispatch.build()
    n, k, rows = 40, 700, 3
    w, x, res, nw = _rows_case(17, n, k, rows, dtype, silu)
    for cfg in CONFIGS:
        outs = []
        for x2d in (False, True):
            monkeypatch.setattr(gemv, "x_in_tile", lambda *a, x2d=x2d: x2d)
            sums = torch.empty_like(x)
            y = gemv.launch_gemv(x, w, silu, cfg, None if norm is None else (res, nw, 1e-5, sums))
            outs.append((y, sums if norm else None))
        if norm == "late" and dtype == torch.float32:
            a, b = outs[0][0].double(), outs[1][0].double()
            assert ((a - b).abs() <= 1e-6 * b.abs().max()).all(), cfg
        else:
            assert torch.equal(outs[0][0], outs[1][0]), cfg
        if norm:
            assert torch.equal(outs[0][1], outs[1][1]), cfg


def _round_bf16(v: torch.Tensor) -> torch.Tensor:
    """float32 -> bf16 as this device's kernels round: to nearest even on the GPU, toward zero under the
    interpreter (see ROUNDED_TOL)."""
    if DEVICE == "cuda":
        return v.to(torch.bfloat16)
    return (v.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


def _residual_case(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, w, residual with every product an exact integer that bf16 cannot hold (257, 259, 513, ...) and
    residuals that make "rounded once" and "rounded twice" (the product, then the sum) differ under either
    rounding mode; and the sum in float32 (exact)."""
    k, prods = 640, torch.tensor([257.0, 257.0, 259.0, 513.0, 257.0, 259.0, 385.0, 515.0])
    w = torch.zeros(prods.numel(), k)
    for j, p in enumerate(prods.tolist()):
        w[j, : int(p)] = 1.0
    res = torch.tensor([0.75, 1.5, 0.75, 1.5, -0.75, -1.5, 1.5, 3.0]).repeat(rows, 1)
    res[1:] += torch.arange(1, rows)[:, None] * 2.0  # each row its own residual (exact in bf16)
    x = torch.ones(1, rows, k)
    return x, w, res.view(1, rows, -1), (prods + res).view(1, rows, -1)


@pytest.mark.parametrize("rows", [1, 3])
def test_residual_is_added_before_the_products_one_rounding(rows: int) -> None:
    """`linear(x, w, residual=r)` (a decode row, and a verify step's `rowwise` rows) writes round(x @ w.T +
    r), rounded once: the sums here differ from round(round(x @ w.T) + r) in every row; each row the same
    bits as a one-row launch."""
    dispatch.build()
    x, w, res, exact = _residual_case(rows)
    xb, wb, rb = (t.to(torch.bfloat16).to(DEVICE) for t in (x, w, res))
    want = _round_bf16(exact)
    twice = _round_bf16(_round_bf16(exact - res).float() + res)
    assert not torch.equal(want, twice)  # the case tells one rounding from two
    got = linear.linear(xb, wb, rowwise=rows > 1, residual=rb)
    assert torch.equal(got.cpu(), want)
    for cfg in CONFIGS:
        assert torch.equal(gemv.launch_gemv(xb, wb, False, cfg, residual=rb).cpu(), want), cfg
    for i in range(rows):
        one = linear.linear(xb[:, i : i + 1], wb, residual=rb[:, i : i + 1])
        assert torch.equal(one[:, 0], got[:, i]), i
    f32 = linear.linear(x.to(DEVICE), w.to(DEVICE), rowwise=rows > 1, residual=res.to(DEVICE))
    assert torch.equal(f32.cpu(), exact)


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("rows", [1, 3])
def test_float_output_is_the_products_values_cast(rows: int, norm: bool, cfg: tuple) -> None:
    """`out_dtype=float32` (the lm_head writing float32 logits: the lowering's `_cast_into_product`): the bits
    of the product in x's dtype cast to float32 — one-row and rowwise launches, with a folded norm or not."""
    dispatch.build()
    g = torch.Generator().manual_seed(3 + rows)
    w = (torch.randn(200, 256, generator=g) / 16).to(torch.bfloat16).to(DEVICE)
    x = torch.randn(rows, 256, generator=g).to(torch.bfloat16).to(DEVICE)
    nw = (1 + torch.randn(256, generator=g) / 4).to(torch.bfloat16).to(DEVICE)
    fold = (None, nw, 1e-5, None) if norm else None
    want = gemv.launch_gemv(x, w, False, cfg, fold).float()
    got = gemv.launch_gemv(x, w, False, cfg, fold, out_dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert not torch.equal(got, (x.double() @ w.double().T).float())  # (the rounding to bf16 is there)
    assert torch.equal(
        linear.linear(x, w, rowwise=True, out_dtype=torch.float32),
        linear.linear(x, w, rowwise=True).float(),
    )
