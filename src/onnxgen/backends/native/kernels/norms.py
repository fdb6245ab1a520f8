"""Row-wise kernels: (skip-)RMSNorm, SiLU * up, and the token embedding's gather.

- `rms_norm(x, skip, w, eps)`: (skip-)RMSNorm in one pass, returning `(y, x + skip)`; float32 inside, each
  output rounded once.
- `silu_mul(g, u)` / `silu_mul_halves(y)`: `silu(g) * u`, float32 inside, rounded once.
- `embedding(idx, w)`: `F.embedding`'s values in one launch that takes part in programmatic dependent launch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import onnxgen.envs as envs
from onnxgen.backends.native.kernels.dispatch import KERNELS, launch_options, triton_cdiv, use_triton
from onnxgen.backends.native.kernels.reference import rms_norm_ref


def rms_norm(
    x: torch.Tensor,
    skip: torch.Tensor | None,
    w: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, Any]:
    """`(y, x + skip)` (None without skip): the values of `reference.rms_norm_ref`, one launch on a Triton
    device (contiguous inputs). `out_dtype`: y in that dtype (the float32 value rounded once to it; the sum
    stays in x's dtype)."""
    if not use_triton(x) or not x.is_contiguous() or (skip is not None and not skip.is_contiguous()):
        y, s = rms_norm_ref(x, skip, w, eps)
        return (y if out_dtype is None else y.to(out_dtype)), s
    # pragma: cuda-begin (Triton launch: CUDA, or the Triton interpreter)
    n = x.shape[-1]
    rows = x.numel() // n
    y = torch.empty_like(x, dtype=out_dtype)
    s = torch.empty_like(x) if skip is not None else x
    block = max(16, 1 << (n - 1).bit_length())
    KERNELS["rms"][(rows,)](
        x,
        skip if skip is not None else x,
        w,
        y,
        s,
        n,
        eps,
        HAS_SKIP=skip is not None,
        BLOCK=block,
        num_warps=8 if block >= 4096 else 4,
        **launch_options(x),
    )
    return y, (s if skip is not None else None)
    # pragma: cuda-end


def embedding(idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Rows `idx` (integer ids, any shape) of the table `w` `[V, H]`: `F.embedding`'s values, shape
    `idx.shape + (H,)`. On a Triton device one launch that, unlike torch's gather, takes part in
    programmatic dependent launch (`launch_options`): a decode step's first kernel then overlaps the launch of
    the next instead of ending the chain; an id outside `[0, V)` reads a row of zeros there (torch raises).
    `ONNXGEN_EMBEDDING_KERNEL=0` (read per call on a Triton device) keeps torch's gather there too."""
    if not use_triton(w) or w.dim() != 2 or not w.is_contiguous() or idx.device != w.device:
        return F.embedding(idx, w)
    # pragma: cuda-begin (Triton launch: CUDA, or the Triton interpreter)
    if not envs.read("EMBEDDING_KERNEL"):
        return F.embedding(idx, w)
    ids = idx.reshape(-1)
    v, h = w.shape
    out = torch.empty((ids.numel(), h), dtype=w.dtype, device=w.device)
    block = min(1024, max(16, 1 << (h - 1).bit_length()))
    if ids.numel():
        KERNELS["embedding"][(ids.numel(), triton_cdiv(h, block))](
            ids, w, out, v, h, BLOCK=block, num_warps=4, **launch_options(w)
        )
    return out.reshape(*idx.shape, h)
    # pragma: cuda-end


def silu_mul(g: torch.Tensor, u: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`silu(g) * u`, computed in float32 and rounded once to g's dtype. With `out=g` the result
    overwrites `g` (callers guarantee nobody else reads it)."""
    if not use_triton(g) or g.shape != u.shape or not (g.is_contiguous() and u.is_contiguous()):
        if g.dtype == torch.float32:
            if out is g and (g.shape == u.shape or g.shape == torch.broadcast_shapes(g.shape, u.shape)):
                return F.silu(g, inplace=True).mul_(u)
            return F.silu(g) * u
        y = F.silu(g.float()).mul_(u.float())
        if out is g and g.shape == y.shape:
            return g.copy_(y)
        return y.to(g.dtype)
    # pragma: cuda-begin (Triton launch: CUDA, or the Triton interpreter)
    if out is None:
        out = torch.empty_like(g)
    n = g.numel()
    block = 2048
    KERNELS["silu_mul"][(triton_cdiv(n, block),)](g, u, out, n, BLOCK=block, num_warps=4, **launch_options(g))
    return out
    # pragma: cuda-end


def silu_mul_halves(y: torch.Tensor) -> torch.Tensor:
    """`silu(g) * u` where `y` `[..., 2N]` holds g in its first half and u in its second (a merged
    gate/up product), float32 inside, rounded once. Written over g in place (callers pass a product nobody
    else reads): returns the view `y[..., :N]`, so the activation peak is that of the unmerged pair."""
    n = y.shape[-1] // 2
    g = y[..., :n]
    if not use_triton(y) or not y.is_contiguous():
        return silu_mul(g, y[..., n:], out=g)
    # pragma: cuda-begin (Triton launch: CUDA, or the Triton interpreter)
    total = y.numel() // 2
    KERNELS["silu_halves"][(triton_cdiv(total, 2048),)](
        y, y, n, total, BLOCK=2048, GELU=False, num_warps=4, **launch_options(y)
    )
    return g
    # pragma: cuda-end


def gelu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`gelu(g) * u` with tanh-approximated gelu (ONNX `Gelu(approximate="tanh")`, `FastGelu`), float32 inside,
    rounded once to g's dtype (torch everywhere: the lowering's merged products use `gelu_mul_halves`)."""
    return (F.gelu(g.float(), approximate="tanh") * u.float()).to(g.dtype)


def gelu_mul_halves(y: torch.Tensor) -> torch.Tensor:
    """`gelu_mul(g, u)` where `y` `[..., 2N]` holds g then u (a merged gate/up product), written over g in
    place as `silu_mul_halves` does; returns the view `y[..., :N]`. One launch on a Triton device."""
    n = y.shape[-1] // 2
    g = y[..., :n]
    if not use_triton(y) or not y.is_contiguous():
        return g.copy_(gelu_mul(g, y[..., n:]))
    # pragma: cuda-begin (Triton launch: CUDA, or the Triton interpreter)
    total = y.numel() // 2
    KERNELS["silu_halves"][(triton_cdiv(total, 2048),)](
        y, y, n, total, BLOCK=2048, GELU=True, num_warps=4, **launch_options(y)
    )
    return g
    # pragma: cuda-end
