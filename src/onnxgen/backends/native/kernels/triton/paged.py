"""Triton kernels for attention over the paged KV pool (imported only when Triton is used).

The contract is `onnxgen.backends.native.paged.attention`'s; this module holds the device code. One
program handles one work item (a sequence and a block of its query rows: token-major rows of the query
heads that share KV head `h`, so a decode packs the whole group into one tile) against one split of that
sequence's keys, reading them page by page through the page table. Scores are kept in base 2
(`qk_scale` includes log2(e)). With several splits, partial results go to a scratch buffer and
`paged_combine_kernel` merges them.
"""

import triton
import triton.language as tl

from onnxgen.backends.native.kernels.triton.core import pdl_begin, softmax_block


@triton.jit
def _paged_block(
    q,
    acc,
    m_i,
    l_i,
    K,
    V,
    pt,
    koff,
    start,
    hi,
    limit,
    window,
    sk_page,
    sk_row,
    sv_page,
    sv_row,
    qk_scale,
    softcap,
    dmask,
    D: tl.constexpr,
    DP: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One block of BLOCK_N keys from `start`, read through the page table (`softmax_block`)."""
    offs = start + tl.arange(0, BLOCK_N)
    if MASKED:
        page = tl.load(pt + offs // PAGE, mask=offs < hi, other=0).to(tl.int64)
    else:
        page = tl.load(pt + offs // PAGE).to(tl.int64)
    row = (offs % PAGE).to(tl.int64)
    kptr = K + (page * sk_page + row * sk_row)[:, None] + koff[None, :]
    vptr = V + (page * sv_page + row * sv_row)[:, None] + koff[None, :]
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


@triton.jit(do_not_specialize=["NSPLIT", "MAXP"])
def paged_attn_kernel(
    Q,
    K,
    V,
    PT,
    QS,
    SL,
    WORK,
    OUT,
    ACC,
    ML,
    SINKS,
    qk_scale,
    softcap,
    window,
    MAXP,
    NSPLIT,
    sk_page,
    sk_row,
    sv_page,
    sv_row,
    N: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINK: tl.constexpr,
    IEEE: tl.constexpr,
    ONE: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: work item `w`'s rows of KV head `h` against split `sp` of its keys. `DIRECT` (one split)
    writes the output; otherwise the split's partial results go to ACC / ML for `paged_combine_kernel`.
    `SINK`: SINKS `[N]` float32 holds a logit per query head that joins the softmax's denominator (split 0
    starts from it: a key of weight exp(sink) and value 0)."""
    pdl_begin(PDL)
    w = tl.program_id(0)  # work item: (sequence, first row)
    h = tl.program_id(1)  # KV head
    sp = tl.program_id(2)  # split of the keys
    if ONE:  # every sequence feeds one token, its rows one item: item w is sequence w's token w, rows 0..G
        b = w
        r0 = 0
        r1 = G
        qs = w
        m = 1
    else:
        b = tl.load(WORK + 3 * w)
        r0 = tl.load(WORK + 3 * w + 1)
        r1 = tl.load(WORK + 3 * w + 2)  # the item's end row (one token's rows when items are per token)
        qs = tl.load(QS + b)
        m = tl.load(QS + b + 1) - qs
    seq_len = tl.load(SL + b)
    rows = r0 + tl.arange(0, BLOCK_M)
    tok = rows // G
    grp = rows % G
    rmask = (rows < G * m) & (rows < r1)
    limit = seq_len - m + tok + 1  # exclusive end of the keys each row's token sees
    dcol = tl.arange(0, DP)
    dmask = dcol < D
    qrow = ((qs + tok) * N + h * G + grp).to(tl.int64)
    q = tl.load(Q + qrow[:, None] * D + dcol[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
    item_hi = tl.max(tl.where(rmask, limit, 0), 0)  # the keys this item's rows see end here
    low_limit = tl.min(tl.where(rmask, limit, 1 << 30), 0)
    # ... and begin here: with a window, at the first row's window (nothing below it is read, not even the
    # page table: pages that fell out of every window may be gone)
    base = tl.where(window > 0, tl.maximum(low_limit - window, 0), 0)
    # keys per split, whole blocks, from this item's own span: a sequence splits the same in any step
    split = ((item_hi - base + NSPLIT - 1) // NSPLIT + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = base + sp * split
    hi = tl.minimum(lo + split, item_hi)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if SINK:
        if sp == 0:  # the sink in base 2, as the scores are
            m_i = tl.load(SINKS + h * G + grp, mask=rmask, other=0.0).to(tl.float32) * 1.4426950408889634
            l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, DP], tl.float32)
    pt = PT + b.to(tl.int64) * MAXP
    koff = h * D + dcol
    # blocks of keys every row sees (at or above the last row's window start, below the first row's limit
    # and hi) need no masks; blocks before them (inside some rows' windows only) and after them do
    full_start = lo + tl.where(
        window > 0, (tl.maximum(item_hi - window - lo, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N, 0
    )
    full_end = full_start + tl.maximum(tl.minimum(hi, low_limit) - full_start, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, tl.minimum(full_start, hi), BLOCK_N):
        acc, m_i, l_i = _paged_block(
            q,
            acc,
            m_i,
            l_i,
            K,
            V,
            pt,
            koff,
            start,
            hi,
            limit,
            window,
            sk_page,
            sk_row,
            sv_page,
            sv_row,
            qk_scale,
            softcap,
            dmask,
            D,
            DP,
            PAGE,
            BLOCK_N,
            True,
            SOFTCAP,
            IEEE,
        )
    for start in range(full_start, full_end, BLOCK_N):
        acc, m_i, l_i = _paged_block(
            q,
            acc,
            m_i,
            l_i,
            K,
            V,
            pt,
            koff,
            start,
            hi,
            limit,
            window,
            sk_page,
            sk_row,
            sv_page,
            sv_row,
            qk_scale,
            softcap,
            dmask,
            D,
            DP,
            PAGE,
            BLOCK_N,
            False,
            SOFTCAP,
            IEEE,
        )
    for start in range(full_end, hi, BLOCK_N):
        acc, m_i, l_i = _paged_block(
            q,
            acc,
            m_i,
            l_i,
            K,
            V,
            pt,
            koff,
            start,
            hi,
            limit,
            window,
            sk_page,
            sk_row,
            sv_page,
            sv_row,
            qk_scale,
            softcap,
            dmask,
            D,
            DP,
            PAGE,
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
        item = ((w * tl.num_programs(1) + h) * NSPLIT + sp).to(tl.int64) * BLOCK_M
        r = tl.arange(0, BLOCK_M)
        tl.store(ACC + (item + r)[:, None] * DP + dcol[None, :], acc)
        tl.store(ML + 2 * (item + r), m_i)
        tl.store(ML + 2 * (item + r) + 1, l_i)


@triton.jit(do_not_specialize=["NSPLIT"])
def paged_combine_kernel(
    ACC,
    ML,
    QS,
    WORK,
    OUT,
    NSPLIT,
    HKV,
    N: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NSP: tl.constexpr,
    ONE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_begin(PDL)
    w = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.program_id(2)  # row within the work item's block
    if ONE:  # `paged_attn_kernel`'s ONE: item w is token w, rows 0..G
        row = r
        qs = w
        m = 1
        r1 = G
    else:
        b = tl.load(WORK + 3 * w)
        row = tl.load(WORK + 3 * w + 1) + r
        qs = tl.load(QS + b)
        m = tl.load(QS + b + 1) - qs
        r1 = tl.load(WORK + 3 * w + 2)
    if (row < G * m) & (row < r1):
        sp = tl.arange(0, NSP)
        smask = sp < NSPLIT
        dcol = tl.arange(0, DP)
        item = ((w * HKV + h) * NSPLIT + sp).to(tl.int64) * BLOCK_M + r
        mx_s = tl.load(ML + 2 * item, mask=smask, other=float("-inf"))
        l_s = tl.load(ML + 2 * item + 1, mask=smask, other=0.0)
        mx = tl.max(mx_s, 0)
        wgt = tl.where(smask & (mx_s > float("-inf")), tl.exp2(mx_s - mx), 0.0)  # maxima are in base 2
        den = tl.sum(wgt * l_s, 0)
        acc = tl.load(ACC + item[:, None] * DP + dcol[None, :], mask=smask[:, None], other=0.0)
        o = tl.sum(acc * wgt[:, None], 0) / tl.where(den > 0, den, 1.0)
        qrow = ((qs + row // G) * N + h * G + row % G).to(tl.int64)
        tl.store(OUT + qrow * D + dcol, o.to(OUT.dtype.element_ty), mask=dcol < D)
