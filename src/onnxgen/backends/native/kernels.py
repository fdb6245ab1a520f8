"""Fused kernels for the native backend: Triton on CUDA, plain torch elsewhere.

Each public function has one torch reference implementation (used on the CPU and as the ground truth
in tests) and, when the tensors live on a CUDA device and Triton imports, a Triton kernel:

- `rms_norm(x, skip, w, eps)`: (skip-)RMSNorm in one pass, returning `(y, x + skip)`; float32 inside,
  each output rounded once.
- `silu_mul(g, u)`: `silu(g) * u`, float32 inside, rounded once.
- `cache_attention(q, kbuf, vbuf, past, ...)`: M query tokens at positions `past .. past + M - 1`
  against a KV buffer that already holds their keys, causal (query t sees keys `[0, past + t]`), with
  the length read from device memory: static shapes over a fixed capacity, so decode (M = 1) and
  prefill chunks alike can live in a CUDA graph. Split-K ("flash decoding") over the keys, the query
  heads that share a KV head packed into one tile; only the valid KV is read.
- `rope_qkv_write(qkv, cos, sin, positions, kv, layer, ...)`: split packed QKV rows, rotate q and k,
  write k and v into the KV buffers at `positions` and return q.
- `linear(x, w, silu_halves)`: `x @ w.T` over a constant `[N, K]` weight; one-row products (batch-1
  decode) run a Triton GEMV, and products of up to `SKINNY_ROWS` rows (batched decode, short prefill
  chunks) a Triton few-row GEMM, where it measured faster than cuBLAS on that shape (chosen once per shape,
  outside CUDA-graph capture); `silu_halves` fuses `silu(g) * u` over a merged `[gate; up]` weight.

`FORCE_TRITON` (tests) runs the Triton kernels on CPU tensors under `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from onnxgen.backends.native.rotary import rope

_log = logging.getLogger(__name__)
FORCE_TRITON = os.environ.get("ONNXGEN_FORCE_TRITON") == "1"
DISABLE_TRITON = os.environ.get("ONNXGEN_NO_TRITON") == "1"
_TRITON: Any = None
_TRITON_OK: bool | None = None


def use_triton(t: torch.Tensor) -> bool:
    """Whether `t`'s kernels run in Triton (CUDA with Triton importable, or `FORCE_TRITON`)."""
    global _TRITON_OK
    if DISABLE_TRITON or not (t.is_cuda or FORCE_TRITON):
        return False
    # pragma: cuda-begin (a CUDA tensor, or the Triton interpreter)
    if _TRITON_OK is None:
        try:
            _build()
            _TRITON_OK = True
        except Exception:  # triton missing or broken: torch path
            _TRITON_OK = False
    return bool(_TRITON_OK)
    # pragma: cuda-end


PDL = os.environ.get("ONNXGEN_PDL", "1") != "0"  # ONNXGEN_PDL=0 turns programmatic dependent launch off
_PDL_DEVICES: dict[int, bool] = {}


def launch_options(t: torch.Tensor) -> dict[str, Any]:
    """The Triton launch options every kernel of this package takes for tensors on `t`'s device: with
    programmatic dependent launch (Hopper and later; `PDL`) a kernel may start while the previous one on the
    stream finishes — each kernel waits for it (`triton_kernels.pdl_begin`) before touching anything it
    wrote, so only the launch latency and the first constant-weight loads overlap. Elsewhere (older GPUs,
    the interpreter) `PDL=False` compiles the waits out."""
    if not (PDL and t.is_cuda):
        return {"PDL": False}
    # pragma: cuda-begin
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if idx not in _PDL_DEVICES:
        from onnxgen.backends.native import triton_kernels

        _PDL_DEVICES[idx] = triton_kernels.HAS_PDL and torch.cuda.get_device_capability(idx) >= (9, 0)
    return {"PDL": True, "launch_pdl": True} if _PDL_DEVICES[idx] else {"PDL": False}
    # pragma: cuda-end


def triton_available() -> bool:
    return use_triton(torch.empty(0, device="cuda")) if torch.cuda.is_available() else False


# --- torch references ----------------------------------------------------------------------------


def rms_norm_ref(
    x: torch.Tensor, skip: torch.Tensor | None, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, Any]:
    # NOTE: as onnxruntime's SkipSimplifiedLayerNormalization: the sum is formed in float32 and
    # normalised unrounded; only the outputs (y and the residual sum) are rounded to x's dtype.
    sf = x.float() + skip.float() if skip is not None else x.float()
    y = (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)
    return y, (sf.to(x.dtype) if skip is not None else None)


def cache_attention_ref(
    q: torch.Tensor,
    kbuf: torch.Tensor,
    vbuf: torch.Tensor,
    past: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
    window: int = -1,
) -> torch.Tensor:
    """Static-shape reference: scores over the whole capacity, masked on the device (see `cache_attention`)."""
    n, m, hkv, cap = q.shape[1], q.shape[2], kbuf.shape[1], kbuf.shape[2]
    idx = torch.arange(cap, device=q.device)
    p0 = past.reshape(()).long()
    limit = p0 + torch.arange(m, device=q.device).unsqueeze(1) + 1  # [M, 1]: exclusive end per query
    keep = idx.unsqueeze(0) < limit
    if window > 0:  # the last `window` positions (onnxruntime's local_window_size)
        keep = keep & (idx.unsqueeze(0) >= limit - window)
    written = (idx < p0 + m).unsqueeze(-1)  # positions past the chunk are garbage (maybe NaN): never read
    k = torch.where(written, kbuf, 0).repeat_interleave(n // hkv, dim=1).float()
    v = torch.where(written, vbuf, 0).repeat_interleave(n // hkv, dim=1).float()
    s = torch.matmul(q.float(), k.transpose(-1, -2)) * scale  # [1, N, M, cap]
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~keep, float("-inf"))
    return torch.matmul(torch.softmax(s, -1), v).to(q.dtype)


# --- public entry points -----------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor, skip: torch.Tensor | None, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, Any]:
    if not use_triton(x) or not x.is_contiguous() or (skip is not None and not skip.is_contiguous()):
        return rms_norm_ref(x, skip, w, eps)
    # pragma: cuda-begin (Triton launch: CUDA, or the Triton interpreter)
    tl_k = _TRITON
    n = x.shape[-1]
    rows = x.numel() // n
    y = torch.empty_like(x)
    s = torch.empty_like(x) if skip is not None else x
    block = max(16, 1 << (n - 1).bit_length())
    tl_k["rms"][(rows,)](
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
    the next instead of ending the chain; an id outside `[0, V)` reads a row of zeros there (torch raises)."""
    if not use_triton(w) or w.dim() != 2 or not w.is_contiguous() or idx.device != w.device:
        return F.embedding(idx, w)
    # pragma: cuda-begin (Triton launch: CUDA, or the Triton interpreter)
    ids = idx.reshape(-1)
    v, h = w.shape
    out = torch.empty((ids.numel(), h), dtype=w.dtype, device=w.device)
    block = min(1024, max(16, 1 << (h - 1).bit_length()))
    if ids.numel():
        _TRITON["embedding"][(ids.numel(), triton_cdiv(h, block))](
            ids, w, out, v, h, BLOCK=block, num_warps=4, **launch_options(w)
        )
    return out.reshape(*idx.shape, h)
    # pragma: cuda-end


def silu_mul(g: torch.Tensor, u: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`silu(g) * u`, computed in float32 and rounded once to g's dtype. With `out=g` the result
    overwrites `g` (callers guarantee nobody else reads it)."""
    if not use_triton(g) or g.shape != u.shape or not (g.is_contiguous() and u.is_contiguous()):
        if g.dtype == torch.float32:
            if out is g and g.shape == torch.broadcast_shapes(g.shape, u.shape):
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
    _TRITON["silu_mul"][(triton_cdiv(n, block),)](g, u, out, n, BLOCK=block, num_warps=4, **launch_options(g))
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
    _TRITON["silu_halves"][(triton_cdiv(total, 2048),)](
        y, y, n, total, BLOCK=2048, num_warps=4, **launch_options(y)
    )
    return g
    # pragma: cuda-end


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


ROWWISE_ROWS = 64  # `rowwise` products of up to this many rows compute each row as a one-row product
ROWS_PER_PROGRAM = max(1, int(os.environ.get("ONNXGEN_GEMV_ROWS", "4")))
"""A GEMV program's rows of x at most (`triton_gemv`: one after another over one weight tile; a verify
step's products). `ONNXGEN_GEMV_ROWS` overrides it (benchmarks/gpu_verify_cost.py)."""
NORM_LATE = os.environ.get("ONNXGEN_NORM_LATE", "1") == "1"
"""Whether a GEMV with its RMSNorm folded in scales its dot product at the end (`triton_gemv`'s `LATE`: no
reduction before the first multiply-add, the normalised row not rounded) instead of normalising x first.
On since it measured faster (0.5B decode graph on an H100, 2026-12-05: 0.629 -> 0.612 ms, the fold then
winning for every product: 176 -> 152 kernels a step; benchmarks/gpu_decode_ablation.py `late`);
`ONNXGEN_NORM_LATE=0` turns it off. Read at each launch and part of the per-shape choice's key."""


FOLD_ALWAYS = os.environ.get("ONNXGEN_FOLD_NORMS", "0") == "1"
"""Whether every RMSNorm folds into the product after it without the per-shape timing against the norm
kernel + plain product (`ONNXGEN_FOLD_NORMS=1`): timed alone, the separate norm kernel may look cheaper
than it is inside a decode graph, where each launch also ends an overlap of programmatic dependent launch
(the H200's 0.5B step kept 25 norm kernels, the H100's none). Read at each choice and part of its key."""


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

    A one-row product on a Triton device runs `triton_gemv` (the configuration measured fastest for its
    shape), and a product of 2..`SKINNY_ROWS` half-precision rows `triton_skinny` when, the first time its
    shape (and row count, rounded up to a power of two) is seen outside graph capture, it measured faster
    than cuBLAS; everything else is `F.linear` (+ `silu_mul_halves`). `rowwise` (a verify step's rows, up to
    `ROWWISE_ROWS`, on a Triton device): every row is computed exactly as a one-row product of this shape is
    (the same GEMV configuration, one launch), so each row's bits do not depend on the other rows.
    `out_dtype` (not with `silu_halves` or `residual`): the result, rounded to x's dtype, in that dtype (the
    GEMV writes it)."""
    rows = x.numel() // x.shape[-1]
    if _as_one_rows(x, rowwise) and _gemv_ok(x, w):
        # pragma: cuda-begin (Triton: CUDA, or the Triton interpreter)
        cfg = _gemv_choice(_first_row(x), w, silu_halves)
        return _gemv(x, w, silu_halves, cfg, residual=residual, out_dtype=out_dtype)
        # pragma: cuda-end
    if out_dtype is not None:
        return linear(x, w, silu_halves, rowwise, residual).to(out_dtype)
    if 1 < rows <= SKINNY_ROWS and x.dtype in (torch.bfloat16, torch.float16) and _gemv_ok(x, w):
        # pragma: cuda-begin (Triton: CUDA, or the Triton interpreter)
        cfg = _skinny_choice(x, w, silu_halves)
        if cfg is not None:
            return _skinny(x, w, silu_halves, cfg, residual)
        # pragma: cuda-end
    return linear_unfused(x, w, silu_halves, residual)


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


SKINNY_ROWS = 128  # products of 2..SKINNY_ROWS half-precision rows may run `triton_skinny`
SKINNY_CONFIGS = ((64, 128, 4, 3), (128, 64, 4, 4), (32, 128, 4, 4), (128, 128, 8, 3))
"""(BLOCK_N, BLOCK_K, warps, stages) tried for each few-row product shape; the fastest, or cuBLAS, is kept
(BLOCK_M: the rows rounded up to a power of two, 16 to 128). Few on purpose: each is compiled for 4 row
blocks and with and without SiLU the first time a shape is timed (Triton caches compiles on disk)."""


def _skinny(
    x: torch.Tensor,
    w: torch.Tensor,
    silu: bool,
    cfg: tuple[int, int, int, int],
    residual: torch.Tensor | None = None,
) -> torch.Tensor:  # pragma: cuda
    """The few-row GEMM launch (`triton_skinny`): x `[..., K]` of M rows (`residual`: `[..., N]`, added)."""
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
    _TRITON["skinny"][(triton_cdiv(n, bn), triton_cdiv(m, bm))](
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


def _skinny_choice(
    x: torch.Tensor, w: torch.Tensor, silu: bool
) -> tuple[int, int, int, int] | None:  # pragma: cuda
    """The few-row GEMM configuration for this shape and row count (rounded up to a power of two), or None
    for cuBLAS."""
    m = x.numel() // x.shape[-1]
    key = ("skinny", 1 << (m - 1).bit_length(), tuple(w.shape), w.dtype, silu, x.device)
    return choose_config(
        key,
        x,
        w,
        SKINNY_CONFIGS,
        lambda wc: linear_unfused(x, wc, silu),
        lambda wc, cfg: _skinny(x, wc, silu, cfg),
    )


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
            return _gemv(x, w, silu_halves, cfg, (skip, nw, eps, s), out_dtype=out_dtype), s
        # pragma: cuda-end
    h, s = rms_norm(x, skip, nw, eps)
    return linear(h, w, silu_halves, rowwise, out_dtype=out_dtype), s


def _rms_gemv_choice(
    x: torch.Tensor, skip: torch.Tensor | None, nw: torch.Tensor, eps: float, w: torch.Tensor, silu: bool
) -> tuple[int, int, int] | None:  # pragma: cuda
    """The GEMV configuration that normalises inside for this shape, or None for the norm kernel followed
    by `linear` (the norm's cost included in both)."""
    s = torch.empty_like(x) if skip is not None else None
    key = ("rms_gemv", tuple(w.shape), w.dtype, silu, skip is not None, NORM_LATE, FOLD_ALWAYS, x.device)
    separate = None if FOLD_ALWAYS else lambda wc: linear(rms_norm(x, skip, nw, eps)[0], wc, silu)
    return choose_config(
        key, x, w, GEMV_CONFIGS, separate, lambda wc, cfg: _gemv(x, wc, silu, cfg, (skip, nw, eps, s))
    )


def _gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    silu: bool,
    cfg: tuple[int, int, int],
    norm: tuple[Any, Any, float, Any] | None = None,
    rope: Rope | None = None,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # pragma: cuda
    """The GEMV launch over x's rows (each computed as a one-row launch would: `triton_gemv`); `norm` =
    (skip or None, norm weight, eps, sum output or None); `rope`: the product is a layer's packed QKV whose k
    and v go to the KV cache (`linear_rope`; `rope.pos` / `rope.slot` hold one entry per row); `residual`:
    x's rows of N added before the rounding (not with `silu` or `rope`); `out_dtype` (not with `silu`, `rope`
    or `residual`): y in that dtype, each value rounded to x's first."""
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
    rb = min(r, ROWS_PER_PROGRAM)
    x2d = X_IN_TILE and x_in_tile(bk, warps, x.element_size()) and (norm is None or NORM_LATE)
    assert residual is None or not (silu or rope is not None)
    res = residual_rows(residual, r, n, y)
    _TRITON["gemv"][(triton_cdiv(n, bn) * triton_cdiv(r, rb),)](
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
        LATE=NORM_LATE,
        X2D=x2d,
        HAS_RES=residual is not None,
        num_warps=warps,
        **launch_options(x),
    )
    return y


def residual_rows(residual: torch.Tensor | None, rows: int, n: int, y: torch.Tensor) -> torch.Tensor:
    """A product's residual as contiguous `[rows, n]` in the dtype of its output `y` (a fresh `[rows, n]`
    tensor), or y itself when there is none (an argument the kernel never reads)."""
    if residual is None:
        return y.view(rows, n)
    assert residual.dtype == y.dtype, (residual.dtype, y.dtype)
    return residual.reshape(rows, n).contiguous()


X_IN_TILE = os.environ.get("ONNXGEN_GEMV_X2D", "1") == "1"
"""Whether the GEMV may load x in its weight tile's shape (`x_in_tile`); `ONNXGEN_GEMV_X2D=0` turns it off
(an A/B on the device: benchmarks/gpu_decode_ablation.py `x1d`; the bits are the same either way)."""


def x_in_tile(block_k: int, warps: int, itemsize: int) -> bool:
    """Whether the GEMV loads x in its weight tile's shape (`triton_gemv`'s `X2D`): when the K tile, at 16
    bytes a thread, needs fewer threads than the program has, so some warps lie along the tile's rows. Then
    x in the tile's own layout saves a conversion through shared memory (two barriers) per K step (sm_90
    SASS, `benchmarks/sass_stats.py`: 4 x 256, 4 warps: 5 barriers -> 1, 200 -> 176 instructions); with
    every warp along K it would only repeat x per row a thread holds. Not with a norm normalised first
    (`_gemv` asks for `NORM_LATE` or no norm): its per-element work would be repeated per row (16 x 128 with
    norm and SiLU: 704 -> 960 instructions)."""
    return block_k * itemsize // 16 < 32 * warps


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
        NORM_LATE,
        FOLD_ALWAYS,
        x.device,
    )
    cfg = CHOICES[key] if key in CHOICES else _rope_gemv_choice(key, x, w, rope, norm)
    if cfg is None:
        return None
    s = torch.empty_like(x) if skip is not None else None
    return _gemv(x, w, False, cfg, (skip, norm[1], norm[2], s) if norm is not None else None, rope), s
    # pragma: cuda-end


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
        return _gemv(x1, wc, False, cfg, None if n1 is None else (n1[0], n1[1], n1[2], s), rope1), s

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

    fold = FOLD_ALWAYS and norm is not None
    return choose_config(key, x1, w, ROPE_GEMV_CONFIGS, None if fold else separate, fused1)


def _gemv_choice(x: torch.Tensor, w: torch.Tensor, silu: bool) -> tuple[int, int, int]:  # pragma: cuda
    """The fastest GEMV configuration for this shape. cuBLAS is not a candidate: (1) a verify step's rows
    must be computed as one-row products are (`rowwise`), which one GEMV launch does for every row and
    cuBLAS could only do row by row; (2) timed alone, a product cannot show what programmatic dependent
    launch gains it inside a decode graph (the chains of run 5 in docs/benchmarks/decode-gpu.md: the GEMV
    chain beat cuBLAS at every shape; end to end the 8B step measured the same either way, run 8)."""
    return choose_config(
        ("gemv", tuple(w.shape), w.dtype, silu, x.device),
        x,
        w,
        GEMV_CONFIGS,
        None,
        lambda wc, cfg: _gemv(x, wc, silu, cfg),
    )


def choose_config(
    key: tuple[Any, ...], x: torch.Tensor, w: torch.Tensor, configs: Any, reference: Any, candidate: Any
) -> Any:  # pragma: cuda
    """The per-shape decision of a kernel with several configurations against its reference: the cached
    choice under `key`; under the interpreter the first configuration; on CUDA `fastest` over
    `reference(weight)` (None: use the reference; no `reference`: a configuration is always chosen) and
    `candidate(weight, config)` for each of `configs`, timed over copies of the weight `w` cycled out of
    the L2."""
    if key in CHOICES:
        return CHOICES[key]
    if not x.is_cuda:
        return configs[0]
    copies = cold_copies(w)
    cands: list[tuple[Any, Any]] = [] if reference is None else [(None, lambda i: reference(copies[i]))]
    cands += [(cfg, lambda i, cfg=cfg: candidate(copies[i], cfg)) for cfg in configs]
    return fastest(key, cands, len(copies))


CHOICES: dict[tuple[Any, ...], Any] = {}  # `fastest`'s decisions, by shape key (read before timing anew)
COLD_BYTES = 192 << 20  # several times the L2: weights cycled through this many bytes are read from HBM


def cold_copies(*ts: torch.Tensor) -> list[Any]:  # pragma: cuda
    """Enough copies of the tensors `ts` (the first copy is `ts` themselves) that launches cycling through
    them find none in the L2, as in a decode step, where every weight is read once: a single tensor, or a
    tuple per copy."""
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    n = max(1, min(64, -(-COLD_BYTES // max(1, nbytes))))
    one = ts[0] if len(ts) == 1 else ts
    return [one] + [(ts[0].clone() if len(ts) == 1 else tuple(t.clone() for t in ts)) for _ in range(n - 1)]


def fastest(key: tuple[Any, ...], candidates: list[tuple[Any, Any]], copies: int) -> Any:  # pragma: cuda
    """The config of the candidate whose launches take the least GPU time, cached under `key`: each
    candidate `(config, fn)` is `fn(i)` over copy `i` of its weights, `max(10, copies)` launches captured
    in one CUDA graph (launch costs that graphs remove do not count; the weights come from HBM, not the
    L2). A candidate that fails to compile or capture is skipped. When first asked during a capture
    (nothing can be timed then), or when the first candidate (the reference) cannot be timed, returns the
    first candidate's config without caching it."""
    if torch.cuda.is_current_stream_capturing():
        return candidates[0][0]
    best: tuple[float, Any] | None = None
    for i, (cfg, fn) in enumerate(candidates):
        try:
            t = _graph_ms(fn, max(10, copies), copies)
        except Exception:  # not here: the reference must time, the others may fail
            if i == 0:
                return cfg
            continue
        if best is None or t < best[0]:
            best = (t, cfg)
    assert best is not None
    CHOICES[key] = best[1]
    return best[1]


def _graph_ms(fn: Any, launches: int, copies: int, replays: int = 5) -> float:  # pragma: cuda
    """GPU milliseconds of `launches` calls `fn(i % copies)` captured in one CUDA graph (the mean of
    `replays` replays after a warm-up replay). A failed capture is repaired before its error propagates."""
    fn(0)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for i in range(launches):
                fn(i % copies)
    except Exception:
        repair_after_failed_capture(torch.device("cuda", torch.cuda.current_device()))
        raise
    graph.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        graph.replay()
    b.record()
    b.synchronize()
    del graph
    return a.elapsed_time(b) / replays


def repair_after_failed_capture(dev: torch.device) -> None:  # pragma: cuda
    """A capture that raised before `capture_end` completed leaves the default CUDA generator in its
    capture state, and every later random op of the process fails ("Offset increment outside graph
    capture"). A small successful capture runs the generator's capture prologue and epilogue again,
    which resets that state; the error of the broken capture itself is not sticky."""
    try:
        torch.cuda.synchronize(dev)
        g = torch.cuda.CUDAGraph()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                torch.zeros(1, device=dev).add_(1)
        del g
    except Exception as exc:  # pragma: no cover - the device is in a state we cannot mend
        _log.error("could not restore the CUDA state after a failed capture: %s", exc)


def linear_unfused(
    x: torch.Tensor, w: torch.Tensor, silu_halves: bool = False, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """The cuBLAS / torch form of `linear` (its reference). With a residual (not with `silu_halves`): in
    float32 `addmm`; in half precision the product is rounded, then the sum is formed in float32 and rounded
    (the values of the unfused product and skip-norm): cuBLAS's bf16 `addmm` did not keep to one rounding
    either (H100, 2026-12-05: 200 rows failed the one-rounding bound of `tests/test_skinny_kernel.py`; the
    cause not isolated — torch lets cuBLAS reduce bf16 in reduced precision by default), and converting the
    weight to float32 per call would cost more than the product. The Triton paths (one-row GEMV, few-row
    GEMM) add the residual before their one rounding."""
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


_MAX_SPLITS = 64  # key splits per (KV head, row block); the combine pass reads this many slots, masked
_LOG2E = 1.4426950408889634  # the kernels keep scores in base 2 (exp2 is one instruction)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def cache_attention(
    q: torch.Tensor,
    kbuf: torch.Tensor,
    vbuf: torch.Tensor,
    past: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
    window: int = -1,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Attention of M new tokens over a KV buffer that already holds their keys and values.

    `q` `[1, N, M, D]` (contiguous): queries at absolute positions `past .. past + M - 1`; `kbuf`/`vbuf`
    `[1, Hkv, cap, D]` valid at `[0, past + M)`; `past` `[1]` integer on the device. Query t sees keys
    `[0, past + t]` (with `window` > 0 only the last `window` of them); scores are soft-capped when
    `softcap` > 0. Returns `[1, N, M, D]` in q's dtype. Shapes depend only on M and the capacity.
    `config` (benchmarks): (rows per program, keys per block, warps, pipeline stages) instead of the
    defaults."""
    if not use_triton(q):
        return cache_attention_ref(q, kbuf, vbuf, past, scale, softcap, window)
    # pragma: cuda-begin (Triton launch: CUDA, or the Triton interpreter)
    n, m, d = q.shape[1], q.shape[2], q.shape[3]
    hkv, cap = kbuf.shape[1], kbuf.shape[2]
    g = n // hkv
    rows = g * m  # per KV head: its G query heads x M tokens, contiguous in q
    dp = max(16, 1 << (d - 1).bit_length())
    # Measured on the H200 (docs/benchmarks/sessions-gpu.md): 64 x 64 tiles, 4 warps, 3 stages for
    # prefill chunks (faster than flash attention at 512 and 1024 queries over an 8k cache); decode
    # rows are the query heads of one KV head. Few distinct configurations = few Triton compiles.
    block_m = min(64, max(16, 1 << (rows - 1).bit_length()))
    block_n, warps, stages = (64 if dp <= 128 else 32), 4, (2 if m == 1 else 3)
    if config is not None:
        block_m, block_n, warps, stages = config
    rblocks = triton_cdiv(rows, block_m)
    rp = rblocks * block_m
    # Split the keys so that about 2 waves of programs run (decode: up to 64 splits of >= 256 keys).
    # The split count is a run-time argument (only "one split or several" is compiled in), so a new
    # KV capacity never triggers a Triton compile.
    want = 64 if m == 1 else triton_cdiv(256, hkv * rblocks)
    nsplit = max(1, min(want, cap // 256, _MAX_SPLITS))
    split = max(block_n, triton_cdiv(triton_cdiv(cap, nsplit), block_n) * block_n)
    nsplit = triton_cdiv(cap, split)
    qc = q.contiguous()
    out = torch.empty_like(qc)
    direct = nsplit == 1
    acc = qc if direct else torch.empty((hkv, nsplit, rp, dp), dtype=torch.float32, device=q.device)
    ml = qc if direct else torch.empty((2, hkv, nsplit, rp), dtype=torch.float32, device=q.device)
    k_ = _TRITON
    k_["attn_split"][(hkv, rblocks, nsplit)](
        qc,
        kbuf,
        vbuf,
        past,
        acc,
        ml,
        out,
        kbuf.stride(1),
        kbuf.stride(2),
        vbuf.stride(1),
        vbuf.stride(2),
        float(scale) * _LOG2E,
        float(softcap),
        int(window),
        m,
        rows,
        rp,
        hkv * nsplit * rp,
        split,
        nsplit,
        D=d,
        DP=dp,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DIRECT=direct,
        SOFTCAP=softcap > 0,
        IEEE=q.dtype == torch.float32 or not q.is_cuda,
        num_warps=warps,
        num_stages=stages,
        **launch_options(q),
    )
    if not direct:
        k_["attn_combine"][(n * m,)](
            acc,
            ml,
            out,
            rows,
            rp,
            hkv * nsplit * rp,
            nsplit,
            D=d,
            DP=dp,
            NSP=_MAX_SPLITS,
            num_warps=4,
            **launch_options(q),
        )
    return out
    # pragma: cuda-end


def rope_qkv_write(
    qkv: torch.Tensor,
    cos_c: torch.Tensor,
    sin_c: torch.Tensor,
    positions: torch.Tensor,
    kv: Any,
    layer: int,
    n: int,
    hkv: int,
    d: int,
    interleaved: bool,
    slots: torch.Tensor | None = None,
    token_major: bool = False,
) -> torch.Tensor:
    """Packed QKV of S tokens `[1, S, (n + 2*hkv) * d]` -> rotated q `[1, n, S, d]` (rotated at `positions`,
    `[S]` int64 on the device); rotated k and v are written into `kv.keys[layer]` / `kv.values[layer]`
    (`[1, hkv, rows, d]`, any strides) at rows `slots` (default: `positions`). One kernel launch on CUDA
    (decode and prefill alike). `token_major`: q is a view of `[1, S, n, d]` storage (what the paged
    attention reads without a copy); otherwise contiguous."""
    if slots is None:
        slots = positions
    kb, vb = kv.keys[layer], kv.values[layer]
    s = qkv.shape[1]
    if not use_triton(qkv):
        q = qkv[..., : n * d].reshape(1, s, n, d)
        k = qkv[..., n * d : (n + hkv) * d].reshape(1, s, hkv, d)
        v = qkv[..., (n + hkv) * d :].reshape(1, s, hkv, d)
        cos = cos_c.index_select(0, positions).unsqueeze(1)
        sin = sin_c.index_select(0, positions).unsqueeze(1)
        q, k = rope(q, cos, sin, interleaved), rope(k, cos, sin, interleaved)
        kv.write_at(layer, slots, k.transpose(1, 2), v.transpose(1, 2))
        return q.contiguous().transpose(1, 2) if token_major else q.transpose(1, 2).contiguous()
    # pragma: cuda-begin (Triton launch: CUDA, or the Triton interpreter)
    qkv = qkv.contiguous()
    shape = (1, s, n, d) if token_major else (1, n, s, d)
    qout = torch.empty(shape, dtype=qkv.dtype, device=qkv.device)
    q = qout.transpose(1, 2) if token_major else qout  # [1, n, S, d] either way
    half = cos_c.shape[1]
    _TRITON["rope_qkv"][(n + 2 * hkv, s)](
        qkv,
        cos_c,
        sin_c,
        positions,
        slots,
        q,
        kb,
        vb,
        q.stride(1),
        q.stride(2),
        kb.stride(1),
        kb.stride(2),
        vb.stride(1),
        vb.stride(2),
        cos_c.stride(0),
        n,
        hkv,
        (n + 2 * hkv) * d,
        D=d,
        HALF=half,
        DP=max(16, 1 << (d - 1).bit_length()),
        INTERLEAVED=interleaved,
        num_warps=1,
        **launch_options(qkv),
    )
    return q
    # pragma: cuda-end


def decode_advance_ref(
    top: torch.Tensor,
    wide: torch.Tensor,
    narrow: torch.Tensor,
    toks: torch.Tensor,
    batch: int,
    max_pages: int,
    page: int,
) -> None:
    """The torch reference of `decode_advance` (tests)."""
    b = batch
    cnt, live = int(wide[4 * b]), int(wide[4 * b + 1])
    toks[cnt % toks.shape[0], :live] = top[:live]
    wide[:live] = top[:live]
    pos = wide[b : b + live] + 1
    wide[b : b + live] = pos
    table = narrow[b : b * (1 + max_pages)].view(b, max_pages)[:live]
    pages = table.gather(1, (pos // page).clamp(max=max_pages - 1).view(-1, 1).to(torch.int64)).view(-1)
    wide[2 * b : 2 * b + live] = pages.to(torch.int64) * page + pos % page
    narrow[:live] = (pos + 1).to(narrow.dtype)
    wide[4 * b] = cnt + 1


def decode_advance(
    top: torch.Tensor,
    wide: torch.Tensor,
    narrow: torch.Tensor,
    toks: torch.Tensor,
    batch: int,
    max_pages: int,
    page: int,
) -> None:
    """The tail of a captured decode step of `batch` rows, so that the next replay is the next decode step
    with no host work: for each live row r (`wide[4B + 1]` of them) the step's chosen token `top[r]`
    becomes its next token id and is recorded in `toks[count % len(toks), r]` (`count` = `wide[4B]`,
    then incremented), its position moves on by one, its slot is looked up in its page-table row and its
    KV length grows by one. `wide` is the graph's int64 `[ids B, positions B, slots B, rows B, count,
    live]`, `narrow` its int32 `[lengths B, page table B x max_pages, ...]`. Rows past `live` (padding)
    are left alone. One launch, on a Triton device; `decode_advance_ref` elsewhere."""
    if not use_triton(top):
        decode_advance_ref(top, wide, narrow, toks, batch, max_pages, page)
        return
    # pragma: cuda-begin (Triton launch: CUDA, or the Triton interpreter)
    _TRITON["decode_advance"][(1,)](
        top,
        top,
        wide,
        narrow,
        toks,
        batch,
        max_pages,
        toks.shape[0],
        1,
        PAGE=page,
        BLOCK=max(16, 1 << (batch - 1).bit_length()),
        PART=False,
        CP=1,
        num_warps=4,
        **launch_options(top),
    )
    # pragma: cuda-end


# A captured decode step's greedy choice in two Triton launches (partial maxima over column blocks, then the
# first maximum of each row inside `decode_advance`) instead of `torch.argmax`'s one-block reduction, which
# is not a programmatic-dependent launch. On since it measured faster (H200, 2026-12-05, decode graphs
# interleaved twice: 0.5B 0.530 -> 0.524 ms, 1B 0.752/0.787 -> 0.744/0.743 ms, greedy tokens equal;
# docs/benchmarks/decode-gpu.md, sixth session); ONNXGEN_GREEDY_IN_ADVANCE=0 turns it off.
GREEDY_IN_ADVANCE = os.environ.get("ONNXGEN_GREEDY_IN_ADVANCE", "1") == "1"
_ARGMAX_BLOCK = 4096  # columns per partial maximum


def greedy_advance(
    logits: torch.Tensor,
    wide: torch.Tensor,
    narrow: torch.Tensor,
    toks: torch.Tensor,
    batch: int,
    max_pages: int,
    page: int,
) -> None:
    """`decode_advance(logits.argmax(-1), ...)` for `[batch, V]` logits: each row's token is its first maximum
    (`torch.argmax`'s choice, ties to the first column). With `GREEDY_IN_ADVANCE` on a Triton device, one
    launch writes partial maxima per block of columns and `decode_advance`'s launch picks each row's token
    from them."""
    if not (GREEDY_IN_ADVANCE and use_triton(logits)):
        decode_advance(logits.argmax(-1), wide, narrow, toks, batch, max_pages, page)
        return
    # pragma: cuda-begin (Triton launch: CUDA, or the Triton interpreter)
    rows, v = logits.shape
    assert rows == batch and logits.stride(1) == 1
    c = triton_cdiv(v, _ARGMAX_BLOCK)
    pv = torch.empty((rows, c), dtype=torch.float32, device=logits.device)
    pi = torch.empty((rows, c), dtype=torch.int32, device=logits.device)
    _TRITON["argmax_part"][(rows, c)](
        logits, pv, pi, v, logits.stride(0), c, BLOCK=_ARGMAX_BLOCK, num_warps=4, **launch_options(logits)
    )
    _TRITON["decode_advance"][(1,)](
        pi,
        pv,
        wide,
        narrow,
        toks,
        batch,
        max_pages,
        toks.shape[0],
        c,
        PAGE=page,
        BLOCK=max(16, 1 << (batch - 1).bit_length()),
        PART=True,
        CP=max(2, 1 << (c - 1).bit_length()),
        num_warps=4,
        **launch_options(logits),
    )
    # pragma: cuda-end


def copy_page_prefix(data: torch.Tensor, src: int, dst: int, n: int) -> None:
    """Copy positions [0, n) of page `src` into page `dst` in every layer of a pool tensor `data`
    (`[layers, 2, pages, page_size, kv_heads, head_dim]`, `PageStorage.data`): one launch on a Triton device
    (a strided torch copy of a pool past 2^31 elements is split into a launch per layer), a slice copy
    elsewhere."""
    if not use_triton(data):
        data[:, :, dst, :n].copy_(data[:, :, src, :n])
        return
    # pragma: cuda-begin (Triton launch: CUDA, or the Triton interpreter)
    assert data.is_contiguous()
    elems = n * data.stride(3)
    block = 1024
    _TRITON["copy_prefix"][(data.shape[0] * 2, triton_cdiv(elems, block))](
        data,
        src,
        dst,
        data.stride(1),
        data.stride(2),
        elems,
        BLOCK=block,
        num_warps=4,
        **launch_options(data),
    )
    # pragma: cuda-end


# --- Triton kernels (built on first use) -------------------------------------------------------------


def _build() -> None:  # pragma: cuda (Triton only)
    global _TRITON
    if _TRITON is not None:
        return
    from onnxgen.backends.native import triton_gemv as tg
    from onnxgen.backends.native import triton_kernels as tk
    from onnxgen.backends.native import triton_skinny as ts

    _TRITON = {
        "rms": tk.rms_kernel,
        "silu_mul": tk.silu_mul_kernel,
        "attn_split": tk.attn_split_kernel,
        "attn_combine": tk.attn_combine_kernel,
        "rope_qkv": tk.rope_qkv_kernel,
        "gemv": tg.gemv_kernel,
        "argmax_part": tk.argmax_part_kernel,
        "silu_halves": tg.silu_mul_halves_kernel,
        "decode_advance": tk.decode_advance_kernel,
        "skinny": ts.skinny_kernel,
        "copy_prefix": tk.copy_prefix_kernel,
        "embedding": tk.embedding_kernel,
    }
