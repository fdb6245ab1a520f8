"""The launches of the products over a constant weight: the one-row GEMV (`triton/gemv.py`) and the few-row
GEMM (`triton/skinny.py`), with the configurations each shape's choice is made among (`linear`).

Read at each launch from `onnxgen.envs`: GEMV_ROWS (a GEMV program's rows of x at most), GEMV_X2D (x may be
loaded in the weight tile's shape: `x_in_tile`) and NORM_LATE (a folded norm scales the product at the end).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

import onnxgen.envs as envs
from onnxgen.backends.native.kernels.dispatch import KERNELS, launch_options, triton_cdiv

if TYPE_CHECKING:
    from onnxgen.backends.native.kernels.linear import Rope

GEMV_CONFIGS = (
    (4, 256, 4),
    (8, 256, 4),
    (8, 128, 4),
    (16, 128, 4),
    (2, 512, 4),
    (4, 512, 4),
    (1, 1024, 4),
    (2, 1024, 4),
    (4, 1024, 4),
    (1, 2048, 8),
    (8, 512, 8),
)
"""(BLOCK_N, BLOCK_K, warps) tried for each one-row product shape; the fastest, or cuBLAS, is kept."""
ROPE_GEMV_CONFIGS = tuple(c for c in GEMV_CONFIGS if c[0] % 2 == 0)  # rotation pairs in one program

SKINNY_ROWS = 128  # products of 2..SKINNY_ROWS half-precision rows may run the few-row GEMM
SKINNY_CONFIGS = ((64, 128, 4, 3), (128, 64, 4, 4), (32, 128, 4, 4), (128, 128, 8, 3))
"""(BLOCK_N, BLOCK_K, warps, stages) tried for each few-row product shape; the fastest, or cuBLAS, is kept
(BLOCK_M: the rows rounded up to a power of two, 16 to 128). Few on purpose: each is compiled for 4 row
blocks and with and without SiLU the first time a shape is timed (Triton caches compiles on disk)."""


def residual_rows(residual: torch.Tensor | None, rows: int, n: int, y: torch.Tensor) -> torch.Tensor:
    """A product's residual as contiguous `[rows, n]` in the dtype of its output `y` (a fresh `[rows, n]`
    tensor), or y itself when there is none (an argument the kernel never reads)."""
    if residual is None:
        return y.view(rows, n)
    assert residual.dtype == y.dtype, (residual.dtype, y.dtype)
    return residual.reshape(rows, n).contiguous()


def x_in_tile(block_k: int, warps: int, itemsize: int) -> bool:
    """Whether the GEMV loads x in its weight tile's shape (`triton/gemv.py`'s `X2D`): when the K tile, at 16
    bytes a thread, needs fewer threads than the program has, so some warps lie along the tile's rows. Then
    x in the tile's own layout saves a conversion through shared memory (two barriers) per K step (sm_90);
    with every warp along K it would only repeat x per row a thread
    holds. Not with a norm normalised first (`launch_gemv` asks for `NORM_LATE` or no norm): its per-element
    work would be repeated per row. `ONNXGEN_GEMV_X2D=0` turns it off (the bits are the same either way)."""
    return block_k * itemsize // 16 < 32 * warps


def launch_gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    silu: bool,
    cfg: tuple[int, int, int],
    norm: tuple[Any, Any, float, Any] | None = None,
    rope: Rope | None = None,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # pragma: cuda
    """The GEMV launch over x's rows (each computed as a one-row launch would: `triton/gemv.py`); `norm` =
    (skip or None, norm weight, eps, sum output or None); `rope`: the product is a layer's packed QKV whose k
    and v go to the KV cache (`linear.linear_rope`; `rope.pos` / `rope.slot` hold one entry per row);
    `residual`: x's rows of N added before the rounding (not with `silu` or `rope`); `out_dtype` (not with
    `silu`, `rope` or `residual`): y in that dtype, each value rounded to x's first."""
    n = w.shape[0] // 2 if silu else w.shape[0]
    k = w.shape[1]
    r = x.numel() // k
    assert out_dtype is None or not (silu or rope is not None or residual is not None)
    y = torch.empty((*x.shape[:-1], n), dtype=out_dtype or x.dtype, device=x.device)
    bn, bk, warps = cfg
    skip, nw, eps, s = norm if norm is not None else (None, x, 0.0, None)
    if rope is not None:
        kb, vb = rope.kv.keys[rope.layer], rope.kv.values[rope.layer]
        ra = (
            rope.cos,
            rope.sin,
            rope.pos,
            rope.slot,
            kb,
            vb,
            kb.stride(1),
            kb.stride(2),
            vb.stride(1),
            vb.stride(2),
            rope.cos.stride(0),
            rope.heads * rope.head_dim,
            rope.kv_heads * rope.head_dim,
        )
    else:
        ra = (x, x, x, x, x, x, 0, 0, 0, 0, 0, 0, 0)
    late = envs.read("NORM_LATE")
    rb = min(r, envs.read("GEMV_ROWS"))
    x2d = envs.read("GEMV_X2D") and x_in_tile(bk, warps, x.element_size()) and (norm is None or late)
    assert residual is None or not (silu or rope is not None)
    res = residual_rows(residual, r, n, y)
    KERNELS["gemv"][(triton_cdiv(n, bn) * triton_cdiv(r, rb),)](
        x.contiguous(),
        w,
        y,
        k,
        n,
        r,
        skip.contiguous() if skip is not None else x,
        nw,
        s if s is not None else y,
        eps,
        *ra,
        res,
        BLOCK_N=bn,
        BLOCK_K=bk,
        SILU=silu,
        NORM=norm is not None,
        HAS_SKIP=skip is not None,
        ROPE=rope is not None,
        HEAD=rope.head_dim if rope is not None else 1,
        HALF=rope.cos.shape[1] if rope is not None else 0,
        RB=rb,
        ONE=r == 1,
        LATE=late,
        X2D=x2d,
        HAS_RES=residual is not None,
        num_warps=warps,
        **launch_options(x),
    )
    return y


def launch_skinny(
    x: torch.Tensor,
    w: torch.Tensor,
    silu: bool,
    cfg: tuple[int, int, int, int],
    residual: torch.Tensor | None = None,
) -> torch.Tensor:  # pragma: cuda
    """The few-row GEMM launch (`triton/skinny.py`): x `[..., K]` of M rows (`residual`: `[..., N]`,
    added)."""
    k = w.shape[1]
    n = w.shape[0] // 2 if silu else w.shape[0]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = cfg
    bm = min(128, max(16, 1 << (m - 1).bit_length()))
    res = residual_rows(residual, m, n, y)
    KERNELS["skinny"][(triton_cdiv(n, bn), triton_cdiv(m, bm))](
        x2,
        w,
        y,
        m,
        n,
        k,
        x2.stride(0),
        y.stride(0),
        res,
        res.stride(0),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        SILU=silu,
        HAS_RES=residual is not None,
        IEEE=not x.is_cuda,
        num_warps=warps,
        num_stages=stages,
        **launch_options(x),
    )
    return y.reshape(*x.shape[:-1], n)
