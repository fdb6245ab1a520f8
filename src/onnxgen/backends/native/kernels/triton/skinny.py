"""Triton GEMM for products of a few rows over a constant `[N, K]` weight (imported only when Triton is used).

The contract is `onnxgen.backends.native.kernels.linear.linear`'s for 2 to `gemv.SKINNY_ROWS` rows of half
precision: `Y = X @ W.T`, float32 accumulation (tensor cores), rounded once to X's dtype; with `SILU`, W
holds `[gate; up]` (`2 * N` rows) and the kernel writes `silu(g) * u` for the `N` output columns, each of g
and u first rounded to the output dtype (the values of the product followed by `silu_mul_halves`);
with `HAS_RES` (not with SILU) the rows of `RES` are added to the float32 sums before the rounding. Such
products (batched decode steps, short prefill chunks, a batch's lm_head) read every weight once and do
little arithmetic per byte: one program owns `BLOCK_N` output columns of `BLOCK_M` rows and streams its
weight rows through the K loop (software-pipelined over `num_stages`), so the tile choice is about keeping
HBM busy, made per shape against cuBLAS (`linear._skinny_choice`). With PDL the first weight tile is
requested before waiting for the previous kernel (see `triton/gemv.py`). `IEEE` multiplies in float32
(the interpreter's `tl.dot` mishandles bf16 operands: the CPU tests use it).
"""

import triton
import triton.language as tl

from onnxgen.backends.native.kernels.triton.core import gdc_launch_dependents, gdc_wait


@triton.jit
def _mma(x, w, acc, IEEE: tl.constexpr):
    """acc + x @ w.T (acc None: a fresh float32 accumulator)."""
    if IEEE:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w), acc)


@triton.jit
def skinny_kernel(
    X,
    W,
    Y,
    M,
    N,
    K,
    sxm,
    sym,
    RES,
    srm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SILU: tl.constexpr,
    HAS_RES: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if PDL:
        gdc_launch_dependents()
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    nmask = rn < N
    wp = W + rn[:, None].to(tl.int64) * K + rk[None, :]  # [BLOCK_N, BLOCK_K]
    xp = X + rm[:, None].to(tl.int64) * sxm + rk[None, :]  # [BLOCK_M, BLOCK_K]
    up = N.to(tl.int64) * K  # SILU: the up rows start N rows below the gate rows
    w0 = tl.load(wp, mask=nmask[:, None] & (rk < K)[None, :], other=0.0)
    if SILU:
        u0 = tl.load(wp + up, mask=nmask[:, None] & (rk < K)[None, :], other=0.0)
    if PDL:
        gdc_wait()
    x = tl.load(xp, mask=mmask[:, None] & (rk < K)[None, :], other=0.0)
    acc = _mma(x, w0, None, IEEE)
    if SILU:
        acc_u = _mma(x, u0, None, IEEE)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kmask = (k0 + rk) < K
        x = tl.load(xp + k0, mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(wp + k0, mask=nmask[:, None] & kmask[None, :], other=0.0)
        acc = _mma(x, w, acc, IEEE)
        if SILU:
            u = tl.load(wp + up + k0, mask=nmask[:, None] & kmask[None, :], other=0.0)
            acc_u = _mma(x, u, acc_u, IEEE)
    y = acc
    if SILU:
        g = acc.to(Y.dtype.element_ty).to(tl.float32)
        u = acc_u.to(Y.dtype.element_ty).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
    if HAS_RES:
        y += tl.load(
            RES + rm[:, None].to(tl.int64) * srm + rn[None, :],
            mask=mmask[:, None] & nmask[None, :],
            other=0.0,
        ).to(tl.float32)
    tl.store(
        Y + rm[:, None].to(tl.int64) * sym + rn[None, :],
        y.to(Y.dtype.element_ty),
        mask=mmask[:, None] & nmask[None, :],
    )
