"""Triton GEMV for one-row products over a constant `[N, K]` weight (imported only when Triton is used).

The contract is `onnxgen.backends.native.kernels.linear.linear`'s: `y = x @ W.T` for x `[1, K]`, float32
accumulation, rounded once to x's dtype. With `SILU`, W holds `[gate; up]` (`2 * N` rows) and the kernel
writes `silu(g) * u` for the `N` output columns, each of g and u first rounded to the output dtype (the
same values as the unfused product followed by `silu_mul`). With `NORM`, x is first RMS-normalised
(`x (+ skip)`, weight `NW`, float32, rounded to the output dtype as `norms.rms_norm` would write it; with
`HAS_SKIP` program 0 also writes the sum `x + skip` to `SUM`), so the norm costs no launch of its own (with
`LATE` its scale is applied after the dot product instead: `_gemv_row`). With
`ROPE` the product is a layer's packed QKV with each rotation pair in adjacent rows: the epilogue rotates q
and k and writes k and v into the KV cache, so rotary costs no launch either. With `HAS_RES` (neither
SILU nor ROPE) the row `RES` is added to the float32 dot product before its one rounding: the product that
feeds a skip-norm forms the norm's sum itself (`lowering._residual_into_product`). One program owns
`BLOCK_N` output rows of one row of x and walks K in `BLOCK_K` steps, keeping a `[BLOCK_N, BLOCK_K]` float32 partial sum that is reduced once at the
end; small `BLOCK_N` gives the hundreds of programs a decode-size weight needs to keep HBM busy.

Rows (`R`, not specialised; the constexprs `ONE` and `RB` give a decode step's one-row launch and a verify
step's launches compiled kernels of their own, whose per-row code is the same). x may hold `R` rows (a
verify step's tokens, `linear.linear(..., rowwise=True)`): a program computes up to `RB` rows of its
output tile one after another (the first weight tile stays in registers, the rest comes from L1/L2), and
the programs that share a tile run side by side (one HBM read). Each row is computed by exactly the code, tile and reduction
order of a one-row launch (`_gemv_row`): a row's result is the same bits whatever else is in the launch
(batch invariance: what lets speculative decoding verify drafts and still return plain greedy decoding's
tokens).
"""

import triton
import triton.language as tl

from onnxgen.backends.native.kernels.triton.core import gdc_launch_dependents, gdc_wait, pdl_begin


@triton.jit
def _x_tile(
    X,
    SKIP,
    NW,
    SUM,
    k0,
    rk,
    first,
    K,
    rstd,
    OUT_TY: tl.constexpr,
    NORM: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    LATE: tl.constexpr,
    X2D: tl.constexpr,
):
    """x[k0 : k0 + BLOCK_K] in float32, ready to multiply the weight tile (`[1, BLOCK_K]`, or with `X2D` the
    columns `rk` broadcast to `[BLOCK_N, BLOCK_K]`), and the row before any norm (`x (+ skip)`, in `rk`'s
    shape). With NORM the normalised row, rounded as the separate RMSNorm would write it; with LATE (the
    norm's scale applied after the dot product) `x (+ skip)` times the norm weight, unrounded, and the
    residual sum written here (where `first`)."""
    kmask = (k0 + rk) < K
    x = tl.load(X + k0 + rk, mask=kmask, other=0.0).to(tl.float32)
    raw = x
    if NORM:
        if HAS_SKIP:
            x += tl.load(SKIP + k0 + rk, mask=kmask, other=0.0).to(tl.float32)
        raw = x
        nw = tl.load(NW + k0 + rk, mask=kmask, other=0.0).to(tl.float32)
        if LATE:
            x = x * nw
            if HAS_SKIP:
                tl.store(SUM + k0 + rk, raw.to(SUM.dtype.element_ty), mask=kmask & first)
        else:
            x = (x * rstd * nw).to(OUT_TY).to(tl.float32)
    if not X2D:
        x = x[None, :]
    return x, raw


@triton.jit
def _rope_store(
    Y,
    y,
    rn,
    nmask,
    pid,
    COS,
    SIN,
    POS,
    SLOT,
    KB,
    VB,
    sk_h,
    sk_s,
    sv_h,
    sv_s,
    cos_stride,
    NQ,
    NK,
    BLOCK_N: tl.constexpr,
    HEAD: tl.constexpr,
    HALF: tl.constexpr,
):
    """The QKV product's epilogue (`ROPE`): y (its BLOCK_N rows, pairs adjacent: interleaved rotary) rounded
    as the product's output, q and k rows rotated at the token's position, all rows written to Y, k and v
    rows also into the KV buffers at the token's slot (`attention.rope_qkv_write`'s values)."""
    y = y.to(Y.dtype.element_ty).to(tl.float32)
    e, o = tl.split(tl.reshape(y, (BLOCK_N // 2, 2)))
    pair = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    lane = (2 * pair) % HEAD
    rot = (2 * pair < NQ + NK) & (lane < 2 * HALF)
    pos = tl.load(POS).to(tl.int64)  # POS, SLOT, Y: this row's
    c = tl.load(COS + pos * cos_stride + lane // 2, mask=rot, other=1.0).to(tl.float32)
    s = tl.load(SIN + pos * cos_stride + lane // 2, mask=rot, other=0.0).to(tl.float32)
    e2 = tl.where(rot, e * c - o * s, e)
    o2 = tl.where(rot, o * c + e * s, o)
    y = tl.reshape(tl.join(e2, o2), (BLOCK_N,)).to(Y.dtype.element_ty)
    tl.store(Y + rn, y, mask=nmask)
    slot = tl.load(SLOT).to(tl.int64)
    kv = rn - NQ
    is_k = (kv >= 0) & (kv < NK)
    tl.store(KB + (kv // HEAD).to(tl.int64) * sk_h + slot * sk_s + kv % HEAD, y, mask=nmask & is_k)
    vv = kv - NK
    tl.store(VB + (vv // HEAD).to(tl.int64) * sv_h + slot * sv_s + vv % HEAD, y, mask=nmask & (vv >= 0))


@triton.jit(do_not_specialize=["R"])
def gemv_kernel(
    X,
    W,
    Y,
    K,
    N,
    R,
    SKIP,
    NW,
    SUM,
    eps,
    COS,
    SIN,
    POS,
    SLOT,
    KB,
    VB,
    sk_h,
    sk_s,
    sv_h,
    sv_s,
    cos_stride,
    NQ,
    NK,
    RES,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SILU: tl.constexpr,
    NORM: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    ROPE: tl.constexpr,
    HEAD: tl.constexpr,
    HALF: tl.constexpr,
    RB: tl.constexpr,
    ONE: tl.constexpr,
    LATE: tl.constexpr,
    X2D: tl.constexpr,
    HAS_RES: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program `i` owns output tile `i // ceil(R / RB)` for rows `RB * (i % ceil(R / RB))` onwards (`RB` rows
    at most, one after another, each by `_gemv_row`'s code: the same bits as a one-row launch); `ONE`
    (R = 1, a decode step's launch) skips that index arithmetic: program `i` owns tile `i`. With PDL
    (programmatic dependent launch) the first `[BLOCK_N, BLOCK_K]` tile of the weights, which no kernel
    writes, is requested before waiting for the previous kernel: the HBM latency of the first loads overlaps
    the previous kernel's tail; the rows after the first find the rest of the weights in the caches."""
    if ONE:
        pid = tl.program_id(0)
        r0 = 0
    else:
        chunks = (R + RB - 1) // RB
        pid = tl.program_id(0) // chunks  # output tile
        r0 = (tl.program_id(0) % chunks) * RB
    if PDL:
        gdc_launch_dependents()
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    rk = tl.arange(0, BLOCK_K)
    wp = W + rn[:, None].to(tl.int64) * K + rk[None, :]
    up = N.to(tl.int64) * K  # SILU: the up rows start N rows below the gate rows
    m0 = nmask[:, None] & (rk < K)[None, :]
    w0 = tl.load(wp, mask=m0, other=0.0, eviction_policy="evict_first")
    u0 = w0
    if SILU:
        u0 = tl.load(wp + up, mask=m0, other=0.0, eviction_policy="evict_first")
    if PDL:
        gdc_wait()
    for i in tl.static_range(RB):
        if r0 + i < R:
            _gemv_row(
                (r0 + i).to(tl.int64),
                X,
                Y,
                K,
                N,
                SKIP,
                NW,
                SUM,
                eps,
                COS,
                SIN,
                POS,
                SLOT,
                KB,
                VB,
                sk_h,
                sk_s,
                sv_h,
                sv_s,
                cos_stride,
                NQ,
                NK,
                RES,
                pid,
                rn,
                nmask,
                rk,
                wp,
                up,
                w0,
                u0,
                BLOCK_N,
                BLOCK_K,
                SILU,
                NORM,
                HAS_SKIP,
                ROPE,
                HEAD,
                HALF,
                LATE,
                X2D,
                HAS_RES,
            )


@triton.jit
def _gemv_row(
    row,
    X,
    Y,
    K,
    N,
    SKIP,
    NW,
    SUM,
    eps,
    COS,
    SIN,
    POS,
    SLOT,
    KB,
    VB,
    sk_h,
    sk_s,
    sv_h,
    sv_s,
    cos_stride,
    NQ,
    NK,
    RES,
    pid,
    rn,
    nmask,
    rk,
    wp,
    up,
    w0,
    u0,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SILU: tl.constexpr,
    NORM: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    ROPE: tl.constexpr,
    HEAD: tl.constexpr,
    HALF: tl.constexpr,
    LATE: tl.constexpr,
    X2D: tl.constexpr,
    HAS_RES: tl.constexpr,
):
    """Row `row` of x (X, SKIP, SUM have rows of K, Y rows of N; POS, SLOT one entry per row) times the
    weights: `w0` / `u0` hold the first tile, the rest is loaded. With `ROPE` (a QKV product whose rotation
    pairs are adjacent rows, even BLOCK_N) `_rope_store` finishes the row. With `NORM` and `LATE` nothing
    is reduced before the first multiply-add: the sum of squares accumulates beside the dot product (from the
    same loads) and `rstd` scales the dot product at the end, `rstd * sum(w * (x (+ skip)) * nw)` — the
    normalised row is not rounded to the output dtype first (closer to a float32 reference than the
    separate norm, not the same bits). `X2D` (tiles whose warps are not all along K, `gemv.x_in_tile`): x
    is loaded as `[BLOCK_N, BLOCK_K]` with its columns broadcast over the rows, i.e. in the weight tile's own
    layout, instead of as `[BLOCK_K]` converted through shared memory (with barriers) at every K step — the
    same values and sums, so the same bits. `HAS_RES`: `RES` (rows of N) added before the rounding."""
    X += row * K
    Y += row * N
    RES += row * N
    SKIP += row * K
    SUM += row * K
    POS += row
    SLOT += row
    rstd = 1.0
    if NORM and not LATE:  # RMSNorm of x (+ skip) first: every program reduces the (small) row itself
        ss = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kmask = (k0 + rk) < K
            xs = tl.load(X + k0 + rk, mask=kmask, other=0.0).to(tl.float32)
            if HAS_SKIP:
                xs += tl.load(SKIP + k0 + rk, mask=kmask, other=0.0).to(tl.float32)
                tl.store(SUM + k0 + rk, xs.to(SUM.dtype.element_ty), mask=kmask & (pid == 0))
            ss += xs * xs
        rstd = 1.0 / tl.sqrt(tl.sum(ss, 0) / K + eps)
    if X2D:  # x's columns in the weight tile's shape; the tile's first row writes the residual sum
        rk2 = tl.broadcast_to(rk[None, :], (BLOCK_N, BLOCK_K))
        first = (tl.arange(0, BLOCK_N) == 0)[:, None] & (pid == 0)
    else:
        rk2 = rk
        first = pid == 0
    x, raw = _x_tile(X, SKIP, NW, SUM, 0, rk2, first, K, rstd, Y.dtype.element_ty, NORM, HAS_SKIP, LATE, X2D)
    if NORM and LATE:
        ss = raw * raw
    acc = w0.to(tl.float32) * x
    if SILU:
        acc_u = u0.to(tl.float32) * x
    for k0 in range(BLOCK_K, K, BLOCK_K):
        x, raw = _x_tile(
            X, SKIP, NW, SUM, k0, rk2, first, K, rstd, Y.dtype.element_ty, NORM, HAS_SKIP, LATE, X2D
        )
        if NORM and LATE:
            ss += raw * raw
        m2 = nmask[:, None] & ((k0 + rk) < K)[None, :]
        w = tl.load(wp + k0, mask=m2, other=0.0, eviction_policy="evict_first").to(tl.float32)
        acc += w * x
        if SILU:
            u = tl.load(wp + up + k0, mask=m2, other=0.0, eviction_policy="evict_first").to(tl.float32)
            acc_u += u * x
    y = tl.sum(acc, 1)
    if SILU:
        u = tl.sum(acc_u, 1)
    if NORM and LATE:
        rstd = 1.0 / tl.sqrt(tl.sum(ss, -1) / K + eps)  # with X2D `[BLOCK_N]`, every row the same
        y = y * rstd
        if SILU:
            u = u * rstd
    if SILU:
        g = y.to(Y.dtype.element_ty).to(tl.float32)
        u = u.to(Y.dtype.element_ty).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
    if ROPE:
        _rope_store(
            Y,
            y,
            rn,
            nmask,
            pid,
            COS,
            SIN,
            POS,
            SLOT,
            KB,
            VB,
            sk_h,
            sk_s,
            sv_h,
            sv_s,
            cos_stride,
            NQ,
            NK,
            BLOCK_N,
            HEAD,
            HALF,
        )
    else:
        if HAS_RES:
            y += tl.load(RES + rn, mask=nmask, other=0.0).to(tl.float32)
        # rounded to x's dtype (the product's), then stored as Y's (float32 logits: the lm_head's Cast)
        tl.store(Y + rn, y.to(X.dtype.element_ty).to(Y.dtype.element_ty), mask=nmask)


@triton.jit
def silu_mul_halves_kernel(Y, OUT, N, TOTAL, BLOCK: tl.constexpr, GELU: tl.constexpr, PDL: tl.constexpr):
    """`OUT[r, c] = silu(Y[r, c]) * Y[r, N + c]` for rows of `2 * N` (a merged gate/up product; with `GELU`
    tanh-approximated gelu instead of silu); `OUT` has rows of `2 * N` too (it may be `Y`: each element is
    read, then written, by the same thread)."""
    pdl_begin(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < TOTAL
    at = (offs // N) * 2 * N + offs % N
    g = tl.load(Y + at, mask=m, other=0.0).to(tl.float32)
    u = tl.load(Y + at + N, mask=m, other=0.0).to(tl.float32)
    if GELU:  # 0.5 * g * (1 + tanh(z)) = g * sigmoid(2z), z = sqrt(2 / pi) * (g + 0.044715 * g^3)
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = g / (1.0 + tl.exp(-2.0 * z))
    else:
        a = g / (1.0 + tl.exp(-g))
    tl.store(OUT + at, (a * u).to(OUT.dtype.element_ty), mask=m)
