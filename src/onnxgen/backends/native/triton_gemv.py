"""Triton GEMV for one-row products over a constant `[N, K]` weight (imported only when Triton is used).

The contract is `onnxgen.backends.native.kernels.linear`'s: `y = x @ W.T` for x `[1, K]`, float32
accumulation, rounded once to x's dtype. With `SILU`, W holds `[gate; up]` (`2 * N` rows) and the kernel
writes `silu(g) * u` for the `N` output columns, each of g and u first rounded to the output dtype (the
same values as the unfused product followed by `silu_mul`). With `NORM`, x is first RMS-normalised
(`x (+ skip)`, weight `NW`, float32, rounded to the output dtype as `kernels.rms_norm` would write it; with
`HAS_SKIP` program 0 also writes the sum `x + skip` to `SUM`), so the norm costs no launch of its own. One
program owns `BLOCK_N` output rows and
walks K in `BLOCK_K` steps, keeping a `[BLOCK_N, BLOCK_K]` float32 partial sum that is reduced once at the
end; small `BLOCK_N` gives the hundreds of programs a decode-size weight needs to keep HBM busy.
"""

import triton
import triton.language as tl

from onnxgen.backends.native.triton_kernels import gdc_launch_dependents, gdc_wait, pdl_begin


@triton.jit
def _x_tile(X, SKIP, NW, k0, rk, K, rstd, OUT_TY: tl.constexpr, NORM: tl.constexpr, HAS_SKIP: tl.constexpr):
    """x[k0 : k0 + BLOCK_K] in float32; with NORM the normalised row, rounded as the separate RMSNorm would
    write it."""
    kmask = (k0 + rk) < K
    x = tl.load(X + k0 + rk, mask=kmask, other=0.0).to(tl.float32)
    if NORM:
        if HAS_SKIP:
            x += tl.load(SKIP + k0 + rk, mask=kmask, other=0.0).to(tl.float32)
        nw = tl.load(NW + k0 + rk, mask=kmask, other=0.0).to(tl.float32)
        x = (x * rstd * nw).to(OUT_TY).to(tl.float32)
    return x


@triton.jit
def gemv_kernel(X, W, Y, K, N, SKIP, NW, SUM, eps, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SILU: tl.constexpr, NORM: tl.constexpr, HAS_SKIP: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """With PDL (programmatic dependent launch) the first `[BLOCK_N, BLOCK_K]` tile of the weights, which
    no kernel writes, is requested before waiting for the previous kernel: the HBM latency of the first
    loads overlaps the previous kernel's tail."""
    pid = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    rk = tl.arange(0, BLOCK_K)
    wp = W + rn[:, None].to(tl.int64) * K + rk[None, :]
    up = N.to(tl.int64) * K  # SILU: the up rows start N rows below the gate rows
    m0 = nmask[:, None] & (rk < K)[None, :]
    w0 = tl.load(wp, mask=m0, other=0.0, eviction_policy="evict_first")
    if SILU:
        u0 = tl.load(wp + up, mask=m0, other=0.0, eviction_policy="evict_first")
    if PDL:
        gdc_wait()
    rstd = 1.0
    if NORM:  # RMSNorm of x (+ skip) first: every program reduces the (small) row itself
        ss = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kmask = (k0 + rk) < K
            xs = tl.load(X + k0 + rk, mask=kmask, other=0.0).to(tl.float32)
            if HAS_SKIP:
                xs += tl.load(SKIP + k0 + rk, mask=kmask, other=0.0).to(tl.float32)
                tl.store(SUM + k0 + rk, xs.to(SUM.dtype.element_ty), mask=kmask & (pid == 0))
            ss += xs * xs
        rstd = 1.0 / tl.sqrt(tl.sum(ss, 0) / K + eps)
    x = _x_tile(X, SKIP, NW, 0, rk, K, rstd, Y.dtype.element_ty, NORM, HAS_SKIP)
    acc = w0.to(tl.float32) * x[None, :]
    if SILU:
        acc_u = u0.to(tl.float32) * x[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        x = _x_tile(X, SKIP, NW, k0, rk, K, rstd, Y.dtype.element_ty, NORM, HAS_SKIP)
        m2 = nmask[:, None] & ((k0 + rk) < K)[None, :]
        w = tl.load(wp + k0, mask=m2, other=0.0, eviction_policy="evict_first").to(tl.float32)
        acc += w * x[None, :]
        if SILU:
            u = tl.load(wp + up + k0, mask=m2, other=0.0, eviction_policy="evict_first").to(tl.float32)
            acc_u += u * x[None, :]
    y = tl.sum(acc, 1)
    if SILU:
        g = y.to(Y.dtype.element_ty).to(tl.float32)
        u = tl.sum(acc_u, 1).to(Y.dtype.element_ty).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
    tl.store(Y + rn, y.to(Y.dtype.element_ty), mask=nmask)


@triton.jit
def silu_mul_halves_kernel(Y, OUT, N, TOTAL, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """`OUT[r, c] = silu(Y[r, c]) * Y[r, N + c]` for rows of `2 * N` (a merged gate/up product); `OUT` has
    rows of `2 * N` too (it may be `Y`: each element is read, then written, by the same thread)."""
    pdl_begin(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < TOTAL
    at = (offs // N) * 2 * N + offs % N
    g = tl.load(Y + at, mask=m, other=0.0).to(tl.float32)
    u = tl.load(Y + at + N, mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + at, (g / (1.0 + tl.exp(-g)) * u).to(OUT.dtype.element_ty), mask=m)
