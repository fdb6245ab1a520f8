"""Triton few-row GEMM on packed int4 MatMulNBits weights (imported only when Triton is used).

`int4_gemm(x, words, scales, zero_points, k, n, block, ...)` computes what `int4.int4_linear` does —
`x @ W.T` over `ops.quant.kmajor`'s K-major words `[K / 8, N]` — for more rows than a GEMV serves (a batch
of decode steps, a verify step, a short prefill chunk): a program owns `BLOCK_M` rows by `BLOCK_N` columns
and walks K in steps of `BK8` word rows. Each step loads the words once (the weight's traffic stays its
packed size, half a byte per weight, whatever the row count), expands nibble `t` of every word into rows
`8 r + t` of a dense tile in registers (`(q - z) * s` in float32, rounded to x's dtype: the values
`int4.int4_dequant` writes), and multiplies it with x's matching columns on the tensor cores (`tl.dot`,
float32 accumulation). So the result is the dequantize-then-matmul path's up to summation order, without
writing or reading a dense weight. float32 x multiplies in IEEE float32 (no TF32), as does the CPU
(the interpreter).

The SiLU variant reads a gate and an up product side by side (`2 * N` columns) and returns
`silu(g) * u`, each rounded to x's dtype first as the unfused ops would.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from onnxgen.backends.native.kernels.gemv import residual_rows
from onnxgen.backends.native.kernels.triton.int4 import _nibble_values, _word_tile


@triton.jit
def _dot(acc, a, b, IEEE: tl.constexpr):
    """acc + a @ b; IEEE: in float32 (float32 models, and the interpreter, whose `tl.dot` mishandles bf16)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return acc + tl.dot(a, b)


@triton.jit
def int4_gemm_kernel(
    X,
    W,
    S,
    Z,
    Y,
    RES,
    M,
    K,
    N,
    LD,
    KW,
    sxm,
    sym,
    BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BK8: tl.constexpr,
    ZP: tl.constexpr,
    SILU: tl.constexpr,
    HAS_RES: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Program (i, j): output columns `i * BLOCK_N ..` of rows `j * BLOCK_M ..`. W, S and Z have rows of LD
    columns (N, or 2N with SILU: gate then up). ZP: 0 none (8), 1 uint8, 2 floats (both `[n_blocks, LD]`).
    KW: word rows (K rounded up to whole quantization blocks, over 8)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    nmask = rn < N
    mmask = rm < M
    xrow = X + rm[:, None].to(tl.int64) * sxm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = acc
    for r0 in range(0, KW, BK8):
        rw = r0 + tl.arange(0, BK8)
        wm = (rw < KW)[:, None] & nmask[None, :]
        w, s, z = _word_tile(W, S, Z, rw, rn, wm, LD, BLOCK, ZP)
        if SILU:
            wu, su, zu = _word_tile(W + N, S + N, Z + N, rw, rn, wm, LD, BLOCK, ZP)
        for t in tl.static_range(8):
            kk = rw * 8 + t
            xt = tl.load(xrow + kk[None, :], mask=mmask[:, None] & (kk < K)[None, :], other=0.0)
            acc = _dot(acc, xt, _nibble_values(w, s, z, t).to(xt.dtype), IEEE)
            if SILU:
                acc_u = _dot(acc_u, xt, _nibble_values(wu, su, zu, t).to(xt.dtype), IEEE)
    y = acc
    if SILU:
        g = acc.to(Y.dtype.element_ty).to(tl.float32)
        up = acc_u.to(Y.dtype.element_ty).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * up
    omask = mmask[:, None] & nmask[None, :]
    if HAS_RES:
        y += tl.load(RES + rm[:, None] * sym + rn[None, :], mask=omask, other=0.0).to(tl.float32)
    tl.store(Y + rm[:, None] * sym + rn[None, :], y.to(Y.dtype.element_ty), mask=omask)


def int4_gemm(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    k: int,
    n: int,
    block: int,
    block_m: int = 16,
    block_n: int = 64,
    bk8: int = 16,
    warps: int = 4,
    stages: int = 3,
    silu: bool = False,
    residual: torch.Tensor | None = None,
) -> Any:
    """`x` `[..., K]` times the K-major packed weights (`ops.quant.kmajor`'s tensors) -> `[..., N]` in x's
    dtype, float32 accumulation; `silu`: the tensors hold a gate and an up product side by side and the
    result is `silu(x @ Wg.T) * (x @ Wu.T)`; `residual` (`[..., N]`): added in float32 before the one
    rounding. A tile is `block_m` rows (at least 16) x `block_n` columns, `bk8` word rows (8 elements of K
    each, at least 16) a step; `warps` and pipeline `stages` per program."""
    ld = words.shape[1]
    assert words.dtype == torch.int32 and block % 8 == 0 and ld == (2 * n if silu else n)
    assert block_m >= 16 and bk8 >= 16 and block_n >= 16
    nb = (k + block - 1) // block
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    zmode = 0 if zero_points is None else (1 if zero_points.dtype == torch.uint8 else 2)
    int4_gemm_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        x2,
        words,
        scales,
        scales if zero_points is None else zero_points,
        y,
        residual_rows(residual, m, n, y),
        m,
        k,
        n,
        ld,
        nb * block // 8,
        x2.stride(0),
        y.stride(0),
        BLOCK=block,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BK8=bk8,
        ZP=zmode,
        SILU=silu,
        HAS_RES=residual is not None,
        IEEE=x.dtype == torch.float32 or not x.is_cuda,
        num_warps=warps,
        num_stages=stages,
    )
    return y.reshape(*x.shape[:-1], n)
