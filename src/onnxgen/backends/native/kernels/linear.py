"""Products over a constant `[N, K]` weight: which kernel runs each, chosen once per shape.

- `linear(x, w, silu_halves)`: `x @ w.T`; one-row products (batch-1 decode) run a Triton GEMV, and products of
  up to `gemv.SKINNY_ROWS` rows (batched decode, short prefill chunks) a Triton few-row GEMM where it timed
  faster than cuBLAS on that shape (chosen outside CUDA-graph capture: `autotune`); `silu_halves` fuses
  `silu(g) * u` over a merged `[gate; up]` weight.
- `rms_linear`: an RMSNorm folded into the one-row GEMV where that timed faster than the norm kernel first.
- `linear_rope`: a one-row QKV product that also rotates q and k and writes k, v into the KV cache.

Read at each choice from `onnxgen.envs` (and part of its cache key): NORM_LATE (a folded norm scales the
product at the end instead of normalising x first) and FOLD_NORMS (every norm folded, untimed).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

import onnxgen.envs as envs
from onnxgen.backends.native.kernels import autotune
from onnxgen.backends.native.kernels.attention import rope_qkv_write
from onnxgen.backends.native.kernels.dispatch import use_triton
from onnxgen.backends.native.kernels.gemv import (
    GEMV_CONFIGS,
    ROPE_GEMV_CONFIGS,
    SKINNY_CONFIGS,
    SKINNY_ROWS,
    launch_gemv,
    launch_skinny,
)
from onnxgen.backends.native.kernels.norms import rms_norm, silu_mul_halves

ROWWISE_ROWS = 64  # `rowwise` products of up to this many rows compute each row as a one-row product


@dataclass(frozen=True)
class Rope:
    """What a QKV product needs to finish a layer's rotary and KV write itself (`linear_rope`): the rotary
    tables `[positions, half]`, the token's position and slot (`[1]` int64 on the device), the KV buffers
    (`kv.keys[layer]` / `kv.values[layer]`: `[1, kv_heads, rows, head_dim]`), and the heads."""

    cos: torch.Tensor
    sin: torch.Tensor
    pos: torch.Tensor
    slot: torch.Tensor
    kv: Any
    layer: int
    heads: int
    kv_heads: int
    head_dim: int


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    silu_halves: bool = False,
    rowwise: bool = False,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`x @ w.T` for `w` `[N, K]` (or `silu(g) * u` over `w` = `[gate; up]`, `[2N, K]`) in x's dtype;
    `residual` (x's rows of N, not with `silu_halves`): `residual + x @ w.T` (a skip-norm's sum formed by the
    product that feeds it), added to the float32 product before its one rounding by the Triton kernels; the
    cuBLAS form rounds the product first (`linear_unfused`).

    A one-row product on a Triton device runs the GEMV (the configuration measured fastest for its shape),
    and a product of 2..`SKINNY_ROWS` half-precision rows the few-row GEMM when, the first time its shape
    (and row count, rounded up to a power of two) is seen outside graph capture, it measured faster than
    cuBLAS; everything else is `F.linear` (+ `silu_mul_halves`). `rowwise` (a verify step's rows, up to
    `ROWWISE_ROWS`, on a Triton device): every row is computed exactly as a one-row product of this shape is
    (the same GEMV configuration, one launch), so each row's bits do not depend on the other rows.
    `out_dtype` (not with `silu_halves` or `residual`): the result, rounded to x's dtype, in that dtype (the
    GEMV writes it)."""
    rows = x.numel() // x.shape[-1]
    if _as_one_rows(x, rowwise) and _gemv_ok(x, w):
        # pragma: cuda-begin (Triton: CUDA, or the Triton interpreter)
        cfg = _gemv_choice(_first_row(x), w, silu_halves)
        return launch_gemv(x, w, silu_halves, cfg, residual=residual, out_dtype=out_dtype)
        # pragma: cuda-end
    if out_dtype is not None:
        return linear(x, w, silu_halves, rowwise, residual).to(out_dtype)
    if 1 < rows <= SKINNY_ROWS and x.dtype in (torch.bfloat16, torch.float16) and _gemv_ok(x, w):
        # pragma: cuda-begin (Triton: CUDA, or the Triton interpreter)
        cfg = _skinny_choice(x, w, silu_halves)
        if cfg is not None:
            return launch_skinny(x, w, silu_halves, cfg, residual)
        # pragma: cuda-end
    return linear_unfused(x, w, silu_halves, residual)


def linear_unfused(
    x: torch.Tensor, w: torch.Tensor, silu_halves: bool = False, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """The cuBLAS / torch form of `linear` (its reference). With a residual (not with `silu_halves`): in
    float32 `addmm`; in half precision the product is rounded, then the sum is formed in float32 and rounded
    (the values of the unfused product and skip-norm): cuBLAS's bf16 `addmm` did not keep to one rounding
    (`tests/kernels/test_skinny_kernel.py`'s one-rounding bound failed on the GPU; torch lets cuBLAS reduce
    bf16 in reduced precision by default), and converting the weight to float32 per call would cost more
    than the product. The Triton paths (one-row GEMV, few-row GEMM) add the residual before their one
    rounding."""
    if residual is not None:
        assert not silu_halves
        x2 = x.reshape(-1, x.shape[-1])
        r2 = residual.reshape(x2.shape[0], w.shape[0])
        if x.dtype == torch.float32:
            y = torch.addmm(r2, x2, w.t())
        else:
            y = (F.linear(x2, w).float() + r2.float()).to(x.dtype)
        return y.reshape(*x.shape[:-1], w.shape[0])
    y = F.linear(x, w)
    return silu_mul_halves(y) if silu_halves else y


def rms_linear(
    x: torch.Tensor,
    skip: torch.Tensor | None,
    nw: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    silu_halves: bool = False,
    rowwise: bool = False,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, Any]:
    """`linear(rms_norm(x, skip, nw, eps)[0], w, silu_halves)` and the residual sum `x + skip` (None without
    skip). A one-row product on a Triton device normalises inside the GEMV (no norm launch) where that
    measured faster, for this shape, than the norm kernel followed by `linear`: every GEMV program reduces
    the row itself, which costs more than the saved launch when programs are many (one row each).
    `rowwise`: as `linear`'s (the one-row decision, each row computed as alone); `out_dtype`: as
    `linear`'s."""
    if (
        _as_one_rows(x, rowwise)
        and _gemv_ok(x, w)
        and x.is_contiguous()
        and (skip is None or (skip.is_contiguous() and skip.shape == x.shape))
    ):
        # pragma: cuda-begin (Triton: CUDA, or the Triton interpreter)
        cfg = _rms_gemv_choice(
            _first_row(x), None if skip is None else _first_row(skip), nw, eps, w, silu_halves
        )
        if cfg is not None:
            s = torch.empty_like(x) if skip is not None else None
            return launch_gemv(x, w, silu_halves, cfg, (skip, nw, eps, s), out_dtype=out_dtype), s
        # pragma: cuda-end
    h, s = rms_norm(x, skip, nw, eps)
    return linear(h, w, silu_halves, rowwise, out_dtype=out_dtype), s


def linear_rope(
    x: torch.Tensor,
    w: torch.Tensor,
    rope: Rope,
    norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None,
    rowwise: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A one-row packed-QKV product whose rotation pairs are adjacent rows (the lowering interleaves them):
    `linear(x, w)` (`norm` = (skip, weight, eps): of `rms_norm(x, skip, ...)`, as `rms_linear`), then q and k
    rotated at `rope.pos` (interleaved pairs) and k, v written at `rope.slot` — `rope_qkv_write`'s values —
    in one GEMV launch, when that measured faster for this shape than the product followed by the rotary
    kernel. Returns (the rotated `[.., N]` rows, the residual sum or None), or None: not fused here (the
    caller runs the separate ops). `rowwise`: x may hold up to `ROWWISE_ROWS` rows (positions and slots one
    per row), each computed as a one-row step would (the one-row decision and configuration)."""
    if not (
        _as_one_rows(x, rowwise)
        and _gemv_ok(x, w)
        and x.is_contiguous()
        and (norm is None or norm[0] is None or norm[0].is_contiguous())
    ):
        return None
    # pragma: cuda-begin (Triton: CUDA, or the Triton interpreter)
    skip = norm[0] if norm is not None else None
    key = (
        "rope_gemv",
        tuple(w.shape),
        w.dtype,
        norm is not None,
        skip is not None,
        envs.read("NORM_LATE"),
        envs.read("FOLD_NORMS"),
        x.device,
    )
    choices = autotune.CHOICES
    cfg = choices[key] if key in choices else _rope_gemv_choice(key, x, w, rope, norm)
    if cfg is None:
        return None
    s = torch.empty_like(x) if skip is not None else None
    return launch_gemv(x, w, False, cfg, (skip, norm[1], norm[2], s) if norm is not None else None, rope), s
    # pragma: cuda-end


def _as_one_rows(x: torch.Tensor, rowwise: bool) -> bool:
    """Whether x's rows are computed as one-row products: one row, or a `rowwise` step's few."""
    rows = x.numel() // x.shape[-1]
    return rows == 1 or (rowwise and rows <= ROWWISE_ROWS)


def _gemv_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a product of x's rows may run a Triton kernel (the GEMV, the few-row GEMM)."""
    return use_triton(x) and x.dtype == w.dtype and w.is_contiguous()


def _first_row(x: torch.Tensor) -> torch.Tensor:
    """x's first row as a one-row `[1, K]` view (what per-shape choices are timed on)."""
    return x.reshape(-1, x.shape[-1])[:1]


# --- the per-shape choices (`autotune`) --------------------------------------------------------------


def _gemv_choice(x: torch.Tensor, w: torch.Tensor, silu: bool) -> tuple[int, int, int]:  # pragma: cuda
    """The fastest GEMV configuration for this shape. cuBLAS is not a candidate: (1) a verify step's rows
    must be computed as one-row products are (`rowwise`), which one GEMV launch does for every row and
    cuBLAS could only do row by row; (2) timed alone, a product cannot show what programmatic dependent
    launch gains it inside a decode graph (docs/benchmarks/decode-gpu.md: in a chain of a decode step's
    products the GEMV beat cuBLAS at every shape; end to end the 8B step measured the same either way)."""
    return autotune.choose_config(
        ("gemv", tuple(w.shape), w.dtype, silu, x.device),
        x,
        w,
        GEMV_CONFIGS,
        None,
        lambda wc, cfg: launch_gemv(x, wc, silu, cfg),
    )


def _skinny_choice(
    x: torch.Tensor, w: torch.Tensor, silu: bool
) -> tuple[int, int, int, int] | None:  # pragma: cuda
    """The few-row GEMM configuration for this shape and row count (rounded up to a power of two), or None
    for cuBLAS."""
    m = x.numel() // x.shape[-1]
    key = ("skinny", 1 << (m - 1).bit_length(), tuple(w.shape), w.dtype, silu, x.device)
    return autotune.choose_config(
        key,
        x,
        w,
        SKINNY_CONFIGS,
        lambda wc: linear_unfused(x, wc, silu),
        lambda wc, cfg: launch_skinny(x, wc, silu, cfg),
    )


def _rms_gemv_choice(
    x: torch.Tensor, skip: torch.Tensor | None, nw: torch.Tensor, eps: float, w: torch.Tensor, silu: bool
) -> tuple[int, int, int] | None:  # pragma: cuda
    """The GEMV configuration that normalises inside for this shape, or None for the norm kernel followed
    by `linear` (the norm's cost included in both). `FOLD_NORMS`: folded without timing against the pair."""
    s = torch.empty_like(x) if skip is not None else None
    late, fold = envs.read("NORM_LATE"), envs.read("FOLD_NORMS")
    key = ("rms_gemv", tuple(w.shape), w.dtype, silu, skip is not None, late, fold, x.device)
    separate = None if fold else lambda wc: linear(rms_norm(x, skip, nw, eps)[0], wc, silu)
    return autotune.choose_config(
        key, x, w, GEMV_CONFIGS, separate, lambda wc, cfg: launch_gemv(x, wc, silu, cfg, (skip, nw, eps, s))
    )


def _rope_gemv_choice(
    key: tuple[Any, ...],
    x: torch.Tensor,
    w: torch.Tensor,
    rope: Rope,
    norm: tuple[torch.Tensor | None, torch.Tensor, float] | None,
) -> tuple[int, int, int] | None:  # pragma: cuda
    """`linear_rope`'s decision for this shape, taken on x's first row (a decode step's shape): the fused
    GEMV configuration, or None for the product followed by the rotary kernel."""
    x1 = _first_row(x)
    rope1 = replace(rope, pos=rope.pos[:1], slot=rope.slot[:1])
    n1 = None if norm is None else (None if norm[0] is None else _first_row(norm[0]), norm[1], norm[2])

    def fused1(wc: torch.Tensor, cfg: tuple[int, int, int]) -> tuple[torch.Tensor, Any]:
        s = torch.empty_like(x1) if n1 is not None and n1[0] is not None else None
        return launch_gemv(x1, wc, False, cfg, None if n1 is None else (n1[0], n1[1], n1[2], s), rope1), s

    def separate(wc: torch.Tensor) -> tuple[torch.Tensor, Any]:
        y, s = rms_linear(x1, n1[0], n1[1], n1[2], wc) if n1 is not None else (linear(x1, wc), None)
        n, hkv, d = rope.heads, rope.kv_heads, rope.head_dim
        rope_qkv_write(
            y.view(1, 1, -1),
            rope.cos,
            rope.sin,
            rope1.pos,
            rope.kv,
            rope.layer,
            n,
            hkv,
            d,
            True,
            slots=rope1.slot,
        )
        return y, s

    fold = envs.read("FOLD_NORMS") and norm is not None
    return autotune.choose_config(key, x1, w, ROPE_GEMV_CONFIGS, None if fold else separate, fused1)
