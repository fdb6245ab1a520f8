"""The Triton device code behind `onnxgen.backends.native.kernels`' norms, attention over a KV buffer, rotary
write, and the programmatic-dependent-launch helpers every kernel uses (imported only when
Triton is used).

Contracts (shapes, masks, what each writes) are documented on the dispatching functions in
`kernels/` modules; this module holds only the device code. Scores inside the attention kernels are kept in
base 2 (`qk_scale` includes log2(e)) so the softmax uses `exp2`.
"""

import triton
import triton.language as tl

try:  # programmatic dependent launch (Triton >= 3.3); without it `dispatch.launch_options` keeps PDL off
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_PDL = True
except ImportError:  # pragma: no cover - older Triton
    gdc_launch_dependents = gdc_wait = None
    HAS_PDL = False


@triton.jit
def pdl_begin(PDL: tl.constexpr):
    """Programmatic dependent launch (`dispatch.launch_options`): let the next kernel on the stream start
    launching, then wait until the previous kernel has finished and its writes are visible. Every kernel
    launched with `launch_pdl` calls this (or, as the GEMV, `gdc_wait` after prefetching constant weights)
    before it reads or writes anything another kernel touches."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def rms_kernel(X, S, W, Y, SUM, N, eps, HAS_SKIP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    xf = tl.load(X + row * N + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_SKIP:  # the sum in float32, normalised unrounded (onnxruntime's SkipSimplifiedLayerNorm)
        xf = xf + tl.load(S + row * N + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(SUM + row * N + cols, xf.to(SUM.dtype.element_ty), mask=m)
    var = tl.sum(xf * xf, axis=0) / N
    w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(Y + row * N + cols, (xf * (1.0 / tl.sqrt(var + eps)) * w).to(Y.dtype.element_ty), mask=m)


@triton.jit
def embedding_kernel(IDS, W, OUT, V, H, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Row `program_id(0)` of OUT = row `IDS[i]` of W `[V, H]` (`program_id(1)`: which BLOCK columns); an id
    outside `[0, V)` gives a row of zeros."""
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tok = tl.load(IDS + row).to(tl.int64)
    ok = (tok >= 0) & (tok < V)
    x = tl.load(W + tok * H + cols, mask=(cols < H) & ok, other=0.0)
    tl.store(OUT + row * H + cols, x, mask=cols < H)


@triton.jit
def silu_mul_kernel(G, U, OUT, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(G + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + offs, (g / (1.0 + tl.exp(-g)) * u).to(OUT.dtype.element_ty), mask=m)


@triton.jit
def load_rows(ptr, nm, dmask, D: tl.constexpr, DP: tl.constexpr, MASKED: tl.constexpr):
    """A [BLOCK_N, DP] block of keys or values; masked rows (`nm` false) and padded columns read 0."""
    if MASKED:
        x = tl.load(ptr, mask=nm[:, None] & dmask[None, :], other=0.0)
    elif D == DP:
        x = tl.load(ptr)
    else:
        x = tl.load(ptr, mask=dmask[None, :], other=0.0)
    return x


@triton.jit
def softmax_block(
    q,
    acc,
    m_i,
    l_i,
    kptr,
    vptr,
    offs,
    hi,
    limit,
    window,
    qk_scale,
    softcap,
    dmask,
    D: tl.constexpr,
    DP: tl.constexpr,
    MASKED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,
):
    """The keys and values of positions `offs` (pointer tiles `kptr`, `vptr`: `[BLOCK_N, DP]`) into the online
    softmax (scores in base 2): the one block step of every attention kernel here and in `triton/paged.py`.
    Unmasked blocks lie wholly below every row's limit and `hi`."""
    nm = offs < hi
    k = load_rows(kptr, nm, dmask, D, DP, MASKED)
    if IEEE:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if SOFTCAP:  # softcap * tanh(x / softcap) on the natural-scale score x
        x = s * (qk_scale / 1.4426950408889634)
        s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * x / softcap)) - 1.0) * 1.4426950408889634
    else:
        s = s * qk_scale
    if MASKED:
        keep = nm[None, :] & (offs[None, :] < limit[:, None])
        if window > 0:
            keep = keep & (offs[None, :] >= limit[:, None] - window)
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = m_new
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = load_rows(vptr, nm, dmask, D, DP, MASKED)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def attn_block(
    q,
    acc,
    m_i,
    l_i,
    kbase,
    vbase,
    start,
    hi,
    limit,
    window,
    sk_s,
    sv_s,
    qk_scale,
    softcap,
    dcol,
    dmask,
    D: tl.constexpr,
    DP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One block of BLOCK_N contiguous keys from `start` (`softmax_block`)."""
    offs = start + tl.arange(0, BLOCK_N)
    kptr = kbase + offs[:, None].to(tl.int64) * sk_s + dcol[None, :]
    vptr = vbase + offs[:, None].to(tl.int64) * sv_s + dcol[None, :]
    return softmax_block(
        q,
        acc,
        m_i,
        l_i,
        kptr,
        vptr,
        offs,
        hi,
        limit,
        window,
        qk_scale,
        softcap,
        dmask,
        D,
        DP,
        MASKED,
        SOFTCAP,
        IEEE,
    )


@triton.jit(do_not_specialize=["NSPLIT"])  # the split count varies with the KV capacity: one compile
def attn_split_kernel(
    Q,
    K,
    V,
    PAST,
    ACC,
    ML,
    OUT,
    SINKS,
    sk_h,
    sk_s,
    sv_h,
    sv_s,
    qk_scale,
    softcap,
    window,
    M,
    R,
    RP,
    ML_STRIDE,
    SPLIT,
    NSPLIT,
    D: tl.constexpr,
    DP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINK: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_begin(PDL)
    h = tl.program_id(0)  # KV head
    rb = tl.program_id(1)  # block of rows (query head within the group x token)
    sp = tl.program_id(2)  # split of the keys
    past = tl.load(PAST).to(tl.int32)
    rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < R
    limit = past + rows % M + 1  # exclusive end of the keys each row's token sees
    dcol = tl.arange(0, DP)
    dmask = dcol < D
    qrow = (h * R + rows).to(tl.int64)
    q = tl.load(Q + qrow[:, None] * D + dcol[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
    item_hi = tl.max(tl.where(rmask, limit, 0), 0)
    low_limit = tl.min(tl.where(rmask, limit, 1 << 30), 0)  # keys below it are seen by every row
    # the splits cut the keys from the first row's window start (0 without a window): SPLIT was planned
    # for the largest span, window + M - 1 keys or the capacity
    base_n = tl.where(window > 0, tl.maximum(low_limit - window, 0), 0)
    lo = base_n + sp * SPLIT
    hi = tl.minimum(lo + SPLIT, item_hi)
    # unmasked blocks: keys every row sees (at or above the last row's window start, below low_limit)
    full_start = lo + tl.where(
        window > 0, (tl.maximum(item_hi - window - lo, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N, 0
    )
    full_end = full_start + tl.maximum(tl.minimum(hi, low_limit) - full_start, 0) // BLOCK_N * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if SINK:  # split 0 starts from the sink logit of each row's query head (base 2, as the scores)
        if sp == 0:
            head = h * (R // M) + rows // M
            m_i = tl.load(SINKS + head, mask=rmask, other=0.0).to(tl.float32) * 1.4426950408889634
            l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, DP], tl.float32)
    kbase = K + h.to(tl.int64) * sk_h
    vbase = V + h.to(tl.int64) * sv_h
    for start in range(lo, tl.minimum(full_start, hi), BLOCK_N):
        acc, m_i, l_i = attn_block(
            q,
            acc,
            m_i,
            l_i,
            kbase,
            vbase,
            start,
            hi,
            limit,
            window,
            sk_s,
            sv_s,
            qk_scale,
            softcap,
            dcol,
            dmask,
            D,
            DP,
            BLOCK_N,
            True,
            SOFTCAP,
            IEEE,
        )
    for start in range(full_start, full_end, BLOCK_N):
        acc, m_i, l_i = attn_block(
            q,
            acc,
            m_i,
            l_i,
            kbase,
            vbase,
            start,
            hi,
            limit,
            window,
            sk_s,
            sv_s,
            qk_scale,
            softcap,
            dcol,
            dmask,
            D,
            DP,
            BLOCK_N,
            False,
            SOFTCAP,
            IEEE,
        )
    for start in range(full_end, hi, BLOCK_N):
        acc, m_i, l_i = attn_block(
            q,
            acc,
            m_i,
            l_i,
            kbase,
            vbase,
            start,
            hi,
            limit,
            window,
            sk_s,
            sv_s,
            qk_scale,
            softcap,
            dcol,
            dmask,
            D,
            DP,
            BLOCK_N,
            True,
            SOFTCAP,
            IEEE,
        )
    if DIRECT:  # one split: normalise and write the output here
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            OUT + qrow[:, None] * D + dcol[None, :],
            o.to(OUT.dtype.element_ty),
            mask=rmask[:, None] & dmask[None, :],
        )
    else:
        base = (h * NSPLIT + sp) * RP
        tl.store(ACC + (base + rows)[:, None].to(tl.int64) * DP + dcol[None, :], acc)
        tl.store(ML + base + rows, m_i)
        tl.store(ML + ML_STRIDE + base + rows, l_i)


@triton.jit(do_not_specialize=["NSPLIT"])
def attn_combine_kernel(
    ACC,
    ML,
    OUT,
    R,
    RP,
    ML_STRIDE,
    NSPLIT,
    D: tl.constexpr,
    DP: tl.constexpr,
    NSP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_begin(PDL)
    row = tl.program_id(0)  # global query row: KV head h, row r within it
    h = row // R
    r = row % R
    sp = tl.arange(0, NSP)
    smask = sp < NSPLIT
    dcol = tl.arange(0, DP)
    idx = (h * NSPLIT + sp) * RP + r
    m = tl.load(ML + idx, mask=smask, other=float("-inf"))
    lsum = tl.load(ML + ML_STRIDE + idx, mask=smask, other=0.0)
    mx = tl.max(m, 0)
    w = tl.where(smask & (m > float("-inf")), tl.exp2(m - mx), 0.0)  # maxima are in base 2
    den = tl.sum(w * lsum, 0)
    acc = tl.load(ACC + idx[:, None].to(tl.int64) * DP + dcol[None, :], mask=smask[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / den
    tl.store(OUT + row.to(tl.int64) * D + dcol, o.to(OUT.dtype.element_ty), mask=dcol < D)


@triton.jit
def rope_qkv_kernel(
    QKV,
    COS,
    SIN,
    POS,
    SLOT,
    QW,
    KW,
    q_eps,
    k_eps,
    QO,
    KB,
    VB,
    sq_h,
    sq_s,
    sk_h,
    sk_s,
    sv_h,
    sv_s,
    cos_stride,
    N,
    HKV,
    ROW,
    D: tl.constexpr,
    HALF: tl.constexpr,
    DP: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_begin(PDL)
    hh = tl.program_id(0)  # head among q (N), k (HKV), v (HKV)
    t = tl.program_id(1)  # token
    pos = tl.load(POS + t).to(tl.int64)
    j = tl.arange(0, DP)
    mj = j < D
    rot = (j < 2 * HALF) & (hh < N + HKV)
    if INTERLEAVED:
        fi = j // 2
        partner = j ^ 1
        sign = tl.where(j % 2 == 0, -1.0, 1.0)
    else:
        fi = tl.where(j < HALF, j, j - HALF)
        partner = tl.where(j < HALF, j + HALF, j - HALF)
        sign = tl.where(j < HALF, -1.0, 1.0)
    base = QKV + t.to(tl.int64) * ROW + hh * D
    x = tl.load(base + j, mask=mj, other=0.0).to(tl.float32)
    xp = tl.load(base + partner, mask=mj & rot, other=0.0).to(tl.float32)
    if NORM:  # q and k heads RMS-normalised with their weight, rounded, then rotated (v as it is)
        isq = hh < N
        normed = hh < N + HKV
        inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + tl.where(isq, q_eps, k_eps))
        wq = tl.load(QW + j, mask=mj & isq, other=0.0).to(tl.float32)
        wk = tl.load(KW + j, mask=mj & normed & ~isq, other=0.0).to(tl.float32)
        wpq = tl.load(QW + partner, mask=mj & rot & isq, other=0.0).to(tl.float32)
        wpk = tl.load(KW + partner, mask=mj & rot & normed & ~isq, other=0.0).to(tl.float32)
        xn = (x * inv * tl.where(isq, wq, wk)).to(QO.dtype.element_ty).to(tl.float32)
        xpn = (xp * inv * tl.where(isq, wpq, wpk)).to(QO.dtype.element_ty).to(tl.float32)
        x = tl.where(normed, xn, x)
        xp = tl.where(normed, xpn, xp)
    c = tl.load(COS + pos * cos_stride + fi, mask=mj & rot, other=1.0).to(tl.float32)
    s = tl.load(SIN + pos * cos_stride + fi, mask=mj & rot, other=0.0).to(tl.float32)
    o = tl.where(rot, x * c + sign * xp * s, x).to(QO.dtype.element_ty)
    tl.store(QO + hh.to(tl.int64) * sq_h + t.to(tl.int64) * sq_s + j, o, mask=mj & (hh < N))
    slot = tl.load(SLOT + t).to(tl.int64)  # the cache row this token's k and v go to
    kh = tl.minimum(tl.maximum(hh - N, 0), HKV - 1).to(tl.int64)
    tl.store(KB + kh * sk_h + slot * sk_s + j, o, mask=mj & (hh >= N) & (hh < N + HKV))
    vh = tl.minimum(tl.maximum(hh - N - HKV, 0), HKV - 1).to(tl.int64)
    tl.store(VB + vh * sv_h + slot * sv_s + j, o, mask=mj & (hh >= N + HKV))
