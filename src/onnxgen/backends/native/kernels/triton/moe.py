"""Triton device code of the mixture-of-experts layer (`kernels.moe`; imported only when Triton is used).

- `moe_route_kernel`: one program per token: softmax of its router logits in float32, the top K (the lowest
  expert index first among equal weights), renormalised when NORMALIZE.
- `moe_align_kernel`: one program: the (token, slot) pairs sorted by expert (stable: pair order inside an
  expert) into blocks of BLOCK_M rows, each expert's rows padded to whole blocks; per block its expert and
  its count of real rows (0: a block no expert needed; its programs do nothing).
- `moe_gemm_kernel`: the grouped product: program (n tile, row block) computes `act(A[rows] @ W[e].T + b[e])`
  for its block's expert e, A's row of pair p being `p // DIV` (fc1 reads token rows, fc2 the pair rows of
  the activation); GATED reads the gate rows and the up rows of W (`N` apart) and writes the activated
  columns; PACKED W holds 4-bit codes (integer with zero points, or FP4's e2m1) dequantized in the K loop
  with their per-QBLOCK scales. The product is rounded to the output dtype before the activation (the values of the unfused
  product followed by the activation, float32 inside). Each row's sums depend on that row alone.
- `moe_combine_kernel`: each token's weighted sum of its K pair rows, float32, rounded once.

`IEEE` multiplies in float32 (the interpreter's `tl.dot` mishandles bf16 operands: the CPU tests use it).
"""

import triton
import triton.language as tl


@triton.jit
def moe_route_kernel(
    LOGITS,
    IDS,
    WTS,
    E,
    stride,
    K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORMALIZE: tl.constexpr,
):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    m = offs < E
    lg = tl.load(LOGITS + t.to(tl.int64) * stride + offs, mask=m, other=float("-inf")).to(tl.float32)
    p = tl.exp(lg - tl.max(lg, 0))
    p = tl.where(m, p, 0.0)
    p = p / tl.sum(p, 0)
    cur = tl.where(m, p, -1.0)
    kk = tl.arange(0, BLOCK_K)
    sel_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    sel_i = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(K):
        v = tl.max(cur, 0)
        i = tl.min(tl.where(cur == v, offs, BLOCK_E), 0)
        sel_w = tl.where(kk == j, v, sel_w)
        sel_i = tl.where(kk == j, i, sel_i)
        cur = tl.where(offs == i, -2.0, cur)
    if NORMALIZE:
        sel_w = sel_w / tl.sum(sel_w, 0)
    km = kk < K
    tl.store(IDS + t * K + kk, sel_i, mask=km)
    tl.store(WTS + t * K + kk, sel_w, mask=km)


@triton.jit
def moe_align_kernel(
    IDS,
    ROWS,
    BLOCK_EXPERT,
    BLOCK_ROWS,
    P,
    E,
    NB,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
):
    ex = tl.arange(0, BLOCK_E)
    c = tl.arange(0, CHUNK)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, P, CHUNK):
        ids = tl.load(IDS + p0 + c, mask=p0 + c < P, other=-1)
        counts += tl.sum((ids[:, None] == ex[None, :]).to(tl.int32), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)
    start = end - padded
    run = start  # each expert's next free sorted row
    for p0 in range(0, P, CHUNK):
        pm = p0 + c < P
        ids = tl.load(IDS + p0 + c, mask=pm, other=-1)
        oh = (ids[:, None] == ex[None, :]).to(tl.int32)
        before = tl.cumsum(oh, 0) - oh  # earlier pairs of the same expert in this chunk
        dest = tl.sum(oh * (before + run[None, :]), 1)
        tl.store(ROWS + dest, p0 + c, mask=pm)
        run += tl.sum(oh, 0)
    for b0 in range(0, NB, CHUNK):
        b = b0 + c
        row0 = b * BLOCK_M
        # the segment holding row0: the number of segments that end at or before it
        seg = tl.sum((end[None, :] <= row0[:, None]).to(tl.int32), 1)
        hit = seg[:, None] == ex[None, :]
        cnt = tl.sum(tl.where(hit, counts[None, :], 0), 1)
        st = tl.sum(tl.where(hit, start[None, :], 0), 1)
        real = tl.minimum(tl.maximum(cnt - (row0 - st), 0), BLOCK_M)
        real = tl.where(seg < E, real, 0)
        bm = b < NB
        tl.store(BLOCK_EXPERT + b, tl.where(seg < E, seg, 0), mask=bm)
        tl.store(BLOCK_ROWS + b, real, mask=bm)


@triton.jit
def _mma(x, w, acc, IEEE: tl.constexpr):
    """acc + x @ w.T."""
    if IEEE:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w), acc)


@triton.jit
def _gelu_tanh(x):
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    th = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0
    return 0.5 * x * (1.0 + th)


@triton.jit
def _activate(g, ACT: tl.constexpr):
    # ACT: the index in `kernels.moe.ACTIVATIONS` (swiglu and geglu are handled by the caller)
    if ACT == 2:  # silu
        y = g / (1.0 + tl.exp(-g))
    elif ACT == 3:  # gelu (tanh)
        y = _gelu_tanh(g)
    elif ACT == 4:  # relu
        y = tl.maximum(g, 0.0)
    elif ACT == 5:  # relu2
        y = tl.maximum(g, 0.0) * tl.maximum(g, 0.0)
    else:  # identity
        y = g
    return y


@triton.jit
def _tile(
    wp,
    S,
    Z,
    srow,
    nm,
    k0,
    K,
    NBLK,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PACKED: tl.constexpr,
    FP4: tl.constexpr,
    HAS_ZP: tl.constexpr,
    QBLOCK: tl.constexpr,
    dtype: tl.constexpr,
):
    """The `[BLOCK_N, BLOCK_K]` weight tile at k0: dense rows at `wp`, or packed 4-bit codes (two per byte,
    the even element in the low nibble) dequantized in float32 with their per-block scales (and zero points)
    and rounded to `dtype`, the values `kernels.moe.unpack4` gives."""
    if PACKED:
        rb = tl.arange(0, BLOCK_K // 2)
        b = tl.load(wp + k0 // 2, mask=nm[:, None] & ((k0 // 2 + rb) < K // 2)[None, :], other=0)
        q = tl.reshape(tl.join(b & 15, b >> 4), [BLOCK_N, BLOCK_K]).to(tl.int32)
        cols = k0 // QBLOCK + tl.arange(0, BLOCK_K // QBLOCK)
        smask = nm[:, None] & (cols < NBLK)[None, :]
        sc = tl.load(S + srow[:, None] + cols[None, :], mask=smask, other=0.0)
        if FP4:
            m = q & 7
            ex = m >> 1
            mb = (m & 1).to(tl.float32)
            mag = tl.where(ex == 0, 0.5 * mb, tl.exp2((ex - 1).to(tl.float32)) * (1.0 + 0.5 * mb))
            v = tl.where((q & 8) != 0, -mag, mag)
            v3 = tl.reshape(v, [BLOCK_N, BLOCK_K // QBLOCK, QBLOCK])
        elif HAS_ZP:
            z = tl.load(Z + srow[:, None] + cols[None, :], mask=smask, other=0.0)
            v3 = tl.reshape(q.to(tl.float32), [BLOCK_N, BLOCK_K // QBLOCK, QBLOCK]) - z[:, :, None]
        else:
            v3 = tl.reshape(q.to(tl.float32), [BLOCK_N, BLOCK_K // QBLOCK, QBLOCK]) - 8.0
        w = tl.reshape(v3 * sc[:, :, None], [BLOCK_N, BLOCK_K]).to(dtype)
    else:
        rk = tl.arange(0, BLOCK_K)
        w = tl.load(wp + k0, mask=nm[:, None] & ((k0 + rk) < K)[None, :], other=0.0)
    return w


@triton.jit
def moe_gemm_kernel(
    A,
    W,
    BIAS,
    S,
    Z,
    OUT,
    ROWS,
    BLOCK_EXPERT,
    BLOCK_ROWS,
    N,
    K,
    sa,
    so,
    DIV,
    alpha,
    beta,
    limit,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PACKED: tl.constexpr,
    FP4: tl.constexpr,
    HAS_ZP: tl.constexpr,
    QBLOCK: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    blk = tl.program_id(1)
    real = tl.load(BLOCK_ROWS + blk)
    if real > 0:
        e = tl.load(BLOCK_EXPERT + blk).to(tl.int64)
        rm = tl.arange(0, BLOCK_M)
        mm = rm < real
        pair = tl.load(ROWS + blk * BLOCK_M + rm, mask=mm, other=0)
        arow = (pair // DIV).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = rn < N
        rk = tl.arange(0, BLOCK_K)
        width = 2 * N if GATED else N  # W's rows per expert
        row = e * width + rn.to(tl.int64)  # W's row of each output column (the gate's, when GATED)
        if PACKED:
            rb = tl.arange(0, BLOCK_K // 2)
            wp = W + row[:, None] * (K // 2) + rb[None, :]
            up = N.to(tl.int64) * (K // 2)  # GATED: the up rows start N rows below the gate rows
        else:
            wp = W + row[:, None] * K + rk[None, :]
            up = N.to(tl.int64) * K
        NBLK = K // QBLOCK  # scale blocks per row (PACKED)
        srow = row * NBLK
        sup = N.to(tl.int64) * NBLK
        ap = A + arow[:, None] * sa + rk[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            km = (k0 + rk) < K
            a = tl.load(ap + k0, mask=mm[:, None] & km[None, :], other=0.0)
            w = _tile(
                wp,
                S,
                Z,
                srow,
                nm,
                k0,
                K,
                NBLK,
                BLOCK_N,
                BLOCK_K,
                PACKED,
                FP4,
                HAS_ZP,
                QBLOCK,
                A.dtype.element_ty,
            )
            acc = _mma(a, w, acc, IEEE)
            if GATED:
                u = _tile(
                    wp + up,
                    S,
                    Z,
                    srow + sup,
                    nm,
                    k0,
                    K,
                    NBLK,
                    BLOCK_N,
                    BLOCK_K,
                    PACKED,
                    FP4,
                    HAS_ZP,
                    QBLOCK,
                    A.dtype.element_ty,
                )
                acc_u = _mma(a, u, acc_u, IEEE)
        if HAS_BIAS:
            bp = BIAS + e * width + rn
            acc += tl.load(bp, mask=nm, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_u += tl.load(bp + N, mask=nm, other=0.0).to(tl.float32)[None, :]
        g = acc.to(OUT.dtype.element_ty).to(tl.float32)
        if GATED:
            u = acc_u.to(OUT.dtype.element_ty).to(tl.float32)
            if ACT == 0:  # swiglu
                g = tl.minimum(g, limit)
                u = tl.minimum(tl.maximum(u, -limit), limit)
                y = g / (1.0 + tl.exp(-alpha * g)) * (u + beta)
            elif ACT == 1:  # geglu
                y = _gelu_tanh(g) * u
            else:
                y = _activate(g, ACT) * u
        elif ACT >= 0:
            y = _activate(g, ACT)
        else:
            y = g
        tl.store(
            OUT + pair[:, None].to(tl.int64) * so + rn[None, :],
            y.to(OUT.dtype.element_ty),
            mask=mm[:, None] & nm[None, :],
        )


@triton.jit
def moe_combine_kernel(Y, WTS, OUT, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = rh < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(K):
        wj = tl.load(WTS + t * K + j)
        row = (t * K + j).to(tl.int64) * H
        acc += wj * tl.load(Y + row + rh, mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + t.to(tl.int64) * H + rh, acc.to(OUT.dtype.element_ty), mask=m)
