"""Triton kernel for MatMulNBits executed on its packed int4 weights (imported only when Triton is used).

`int4_linear(x, words, scales, zero_points, k, n, block)` computes `x @ W.T` where `W` `[N, K]` is
MatMulNBits' B held K-major (`ops.quant.kmajor`, done once at load): int32 words `[K / 8, N]`, word `(r, c)`
holding elements `8r .. 8r + 7` of output row `c` (nibble `j` = element `8r + j`), the same bytes as the
builder's `[N, n_blocks, block / 2]`; `scales` `[n_blocks, N]`; zero points absent (8), uint8 `[n_blocks,
N]` (one per block, unpacked), or floats `[n_blocks, N]`. Nothing is dequantized in memory: the weights'
traffic is their packed size (half a byte per weight plus the scales).

Why K-major: a program owns `BLOCK_N` output columns and walks K in steps of `BK8` word rows; a thread's
words are contiguous along N (16-byte loads), the x elements of its word rows are the same for all its
columns (a few scalar loads per step, broadcast), and the sum over K stays in registers until one reduction
at the end — no shared memory, barrier or shuffle in the loop (checked in its sm_90 SASS, compiled offline:
fewer instructions per weight and no barriers, where the N-major design it replaced had several per step).
A nibble becomes a float without the conversion unit: read where it sits after one of four shifts per word,
at mantissa bits 12..15 (`1 + q / 2048`) or 16..19 (`1 + q / 128`), masked and or-ed with 1.0's bits in
one `lop3` (`ONE_BITS` is passed at run time so that the constant sits in a register); per word,
`sum((q - z) x) = 2048 (t12 - x12) + 128 (t16 - x16) - z (x12 + x16)` from the two products' sums `t`
and the sums of the x elements read at each position. Its error against float64 is about 4e-5 relative
(the `1 + q / 2048` floats keep 13 bits of q·x; `benchmarks/int4_precision.py`), far below a bf16 or fp16 output's rounding, so this is
`SCHEME=1`, for half-precision x; float32 x takes `SCHEME=0` (each nibble moved to bits 19..22,
`1 + q / 16`: eight shifts per word, float32's own error). Its contract is
`ops.quant.dequant_matmul_nbits`'s followed by a MatMul (tested against it under `TRITON_INTERPRET=1` on
the CPU). Used by the lowering's `Int4Linear` with `int4="packed"` (`ops.quant`; not the default: steps of
more than `GEMV_ROWS` rows dequantize per product, `device.int4_mode`). Its bandwidth against the N-major
design: docs/benchmarks/decode-gpu.md.

`int4_dequant` writes the dense weight K-major (`[K, N]`, one pass: each word's eight values to eight rows,
stores contiguous along N) for products of more rows (prefill chunks), which then run as one dense matmul.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from onnxgen.backends.native.kernels.dispatch import launch_options
from onnxgen.backends.native.kernels.gemv import residual_rows
from onnxgen.backends.native.kernels.triton.core import gdc_launch_dependents, gdc_wait


@triton.jit
def _at(v, SHIFT: tl.constexpr, MASK: tl.constexpr, ONE_BITS):
    """The float with 1.0's exponent whose mantissa holds `v`'s bits under MASK after a shift left by SHIFT
    (right if negative): `1 + q * 2^(p - 23)` for a nibble q moved to bit p."""
    if SHIFT > 0:
        v = v << SHIFT
    elif SHIFT < 0:
        v = v >> -SHIFT
    return ((v & MASK) | ONE_BITS).to(tl.float32, bitcast=True)


@triton.jit
def _x(
    xo,
    j: tl.constexpr,
    xk,
    K,
    X,
    SKIP,
    NW,
    SUM,
    store,
    EVEN: tl.constexpr,
    NORM: tl.constexpr,
    HAS_SKIP: tl.constexpr,
):
    """Element j of x for each word row (`[BK8, 1]` offsets `xo` into a row of X, float32) and its square.
    NORM: x (+ SKIP, the sum also stored to SUM where `store`) times the norm weight NW; the square is of
    the unweighted sum (an RMSNorm's `rstd` comes from their total after the loop); else the square is 0."""
    km = xk + j < K
    if EVEN:
        x = tl.load(X + xo + j).to(tl.float32)
    else:
        x = tl.load(X + xo + j, mask=km, other=0.0).to(tl.float32)
    sq = x * 0.0
    if NORM:
        if HAS_SKIP:  # the sum in float32, normalised unrounded (as `norms.rms_norm`)
            x += tl.load(SKIP + xo + j, mask=km, other=0.0).to(tl.float32)
            tl.store(SUM + xo + j, x.to(SUM.dtype.element_ty), mask=km & store)
        sq = x * x
        x = x * tl.load(NW + xk + j, mask=km, other=0.0).to(tl.float32)
    return x, sq


@triton.jit
def _word_sums(w, x0, x1, x2, x3, x4, x5, x6, x7, ONE_BITS, SCHEME: tl.constexpr):
    """Per word (`[BK8, BLOCK_N]`): `sum_j q_j x_j` over its eight nibbles, and `sum_j x_j` (`[BK8, 1]`)."""
    if SCHEME == 1:
        t12 = _at(w, 12, 0xF000, ONE_BITS) * x0  # nibble 0 at bits 12..15
        t12 += _at(w, 8, 0xF000, ONE_BITS) * x1
        t12 += _at(w, 0, 0xF000, ONE_BITS) * x3
        t12 += _at(w, -8, 0xF000, ONE_BITS) * x5
        t16 = _at(w, 8, 0xF0000, ONE_BITS) * x2  # nibble 2 at bits 16..19
        t16 += _at(w, 0, 0xF0000, ONE_BITS) * x4
        t16 += _at(w, -8, 0xF0000, ONE_BITS) * x6
        t16 += _at(w, -12, 0xF0000, ONE_BITS) * x7
        x12 = x0 + x1 + x3 + x5
        x16 = x2 + x4 + x6 + x7
        qx = 2048.0 * t12 + 128.0 * t16 - (2048.0 * x12 + 128.0 * x16)
    else:
        t = _at(w, 19, 0x780000, ONE_BITS) * x0
        t += _at(w, 15, 0x780000, ONE_BITS) * x1
        t += _at(w, 11, 0x780000, ONE_BITS) * x2
        t += _at(w, 7, 0x780000, ONE_BITS) * x3
        t += _at(w, 3, 0x780000, ONE_BITS) * x4
        t += _at(w, -1, 0x780000, ONE_BITS) * x5
        t += _at(w, -5, 0x780000, ONE_BITS) * x6
        t += _at(w, -9, 0x780000, ONE_BITS) * x7
        x12 = x0 + x1 + x2 + x3
        x16 = x4 + x5 + x6 + x7
        qx = 16.0 * t - 16.0 * (x12 + x16)
    return qx, x12 + x16


@triton.jit
def _block_dot(qx, xs, S, Z, at, km, ZP: tl.constexpr, EVEN: tl.constexpr):
    """`scale * (sum(q x) - z * sum(x))` with the scales and zero points at `at` (`[BK8, BLOCK_N]` offsets)."""
    if EVEN:
        sc = tl.load(S + at).to(tl.float32)
    else:
        sc = tl.load(S + at, mask=km, other=0.0).to(tl.float32)
    if ZP == 0:
        return sc * (qx - 8.0 * xs)
    if EVEN:
        z = tl.load(Z + at).to(tl.float32)
    else:
        z = tl.load(Z + at, mask=km, other=0.0).to(tl.float32)
    return sc * (qx - z * xs)


@triton.jit
def int4_gemv_kernel(
    X,
    W,
    S,
    Z,
    Y,
    SKIP,
    NW,
    SUM,
    eps,
    RES,
    K,
    N,
    LD,
    NB,
    sxm,
    sym,
    ONE_BITS,
    BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BK8: tl.constexpr,
    ZP: tl.constexpr,
    EVEN: tl.constexpr,
    SCHEME: tl.constexpr,
    SILU: tl.constexpr,
    NORM: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    HAS_RES: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (i, m): output columns `i * BLOCK_N ..` of row m of x. W, S and Z have rows of LD columns
    (N, or 2N with SILU: gate columns then up columns, and the output is `silu(g) * u`, each rounded to Y's
    dtype first as the unfused product would be). ZP: 0 none (8), 1 uint8, 2 floats (both `[NB, LD]`).
    EVEN: K a multiple of `BK8 * 8` and of BLOCK, N of BLOCK_N (no masks). The next step's words are
    requested before this step's arithmetic. With PDL (programmatic dependent launch,
    `dispatch.launch_options`) the first step's words, which no kernel writes, are requested before waiting
    for the previous kernel, as in the bf16 GEMV."""
    if PDL:
        gdc_launch_dependents()
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    WPB: tl.constexpr = BLOCK // 8  # words per quantization block
    KW = NB * WPB  # word rows (K rounded up to whole blocks)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    rr = tl.arange(0, BK8)
    wp = W + rr[:, None].to(tl.int64) * LD + rn[None, :]
    bp = (rr // WPB)[:, None] * LD + rn[None, :]  # scales and zero points: the word row's block
    xrow = m * sxm + rr[:, None] * 8  # offsets of x's (and SKIP's, SUM's) elements in row m
    store = pid_n == 0
    ss = tl.zeros([BK8, 1], dtype=tl.float32)
    acc = tl.zeros([BK8, BLOCK_N], dtype=tl.float32)
    acc_u = acc
    m0 = (rr < KW)[:, None] & nmask[None, :]
    if EVEN:
        w_next = tl.load(wp, eviction_policy="evict_first")
    else:
        w_next = tl.load(wp, mask=m0, other=0, eviction_policy="evict_first")
    u_next = w_next
    if SILU:
        u_next = tl.load(wp + N, mask=m0, other=0, eviction_policy="evict_first")
    if PDL:
        gdc_wait()
    for r0 in range(0, KW, BK8):
        w = w_next
        u = u_next
        mn = ((r0 + BK8 + rr) < KW)[:, None] & nmask[None, :]
        w_next = tl.load(wp + (r0 + BK8) * LD, mask=mn, other=0, eviction_policy="evict_first")
        if SILU:
            u_next = tl.load(wp + (r0 + BK8) * LD + N, mask=mn, other=0, eviction_policy="evict_first")
        km = ((r0 + rr) < KW)[:, None] & nmask[None, :]
        at = bp + (r0 // WPB) * LD
        xo = xrow + r0 * 8
        xk = (r0 + rr[:, None]) * 8
        x0, q0 = _x(xo, 0, xk, K, X, SKIP, NW, SUM, store, EVEN, NORM, HAS_SKIP)
        x1, q1 = _x(xo, 1, xk, K, X, SKIP, NW, SUM, store, EVEN, NORM, HAS_SKIP)
        x2, q2 = _x(xo, 2, xk, K, X, SKIP, NW, SUM, store, EVEN, NORM, HAS_SKIP)
        x3, q3 = _x(xo, 3, xk, K, X, SKIP, NW, SUM, store, EVEN, NORM, HAS_SKIP)
        x4, q4 = _x(xo, 4, xk, K, X, SKIP, NW, SUM, store, EVEN, NORM, HAS_SKIP)
        x5, q5 = _x(xo, 5, xk, K, X, SKIP, NW, SUM, store, EVEN, NORM, HAS_SKIP)
        x6, q6 = _x(xo, 6, xk, K, X, SKIP, NW, SUM, store, EVEN, NORM, HAS_SKIP)
        x7, q7 = _x(xo, 7, xk, K, X, SKIP, NW, SUM, store, EVEN, NORM, HAS_SKIP)
        if NORM:
            ss += ((q0 + q1) + (q2 + q3)) + ((q4 + q5) + (q6 + q7))
        qx, xs = _word_sums(w, x0, x1, x2, x3, x4, x5, x6, x7, ONE_BITS, SCHEME)
        acc += _block_dot(qx, xs, S, Z, at, km, ZP, EVEN)
        if SILU:
            qu, _ = _word_sums(u, x0, x1, x2, x3, x4, x5, x6, x7, ONE_BITS, SCHEME)
            acc_u += _block_dot(qu, xs, S, Z, at + N, km, ZP, EVEN)
    y = tl.sum(acc, axis=0)
    up = y
    if SILU:
        up = tl.sum(acc_u, axis=0)
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(ss) / K + eps)
        y = y * rstd
        up = up * rstd
    if SILU:
        g = y.to(Y.dtype.element_ty).to(tl.float32)
        up = up.to(Y.dtype.element_ty).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * up
    if HAS_RES:
        y += tl.load(RES + m * sym + rn, mask=nmask, other=0.0).to(tl.float32)
    tl.store(Y + m * sym + rn, y.to(Y.dtype.element_ty), mask=nmask)


def int4_linear(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    k: int,
    n: int,
    block: int,
    block_n: int = 32,
    bk8: int = 64,
    warps: int = 4,
    scheme: int | None = None,
    silu: bool = False,
    norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
) -> Any:
    """`x` `[..., K]` times the K-major packed weights (`ops.quant.kmajor`'s tensors) -> `[..., N]` in x's
    dtype (float32 accumulation). `silu`: the tensors hold a gate and an up product side by side (`2 * N`
    columns, `ops.quant.Int4LinearSiluMul`) and the result is `silu(x @ Wg.T) * (x @ Wu.T)`. `block_n`
    output columns and `bk8` word rows (8 elements of K each) per program step, `warps` per program.
    `scheme` (benchmarks): the kernel's SCHEME; by default 0 for float32 x and 1 for half precision.
    `norm` = (skip or None, weight, eps): x is RMS-normalised first (`norms.rms_norm`'s values, the
    normalised row unrounded) and the result is (product, the residual sum `x + skip` or None).
    `residual` (`[..., N]`): added to the product in float32 before the one rounding."""
    ld = words.shape[1]
    assert words.dtype == torch.int32 and block % 8 == 0 and ld == (2 * n if silu else n)
    nb = (k + block - 1) // block
    x2 = x.reshape(-1, k).contiguous()
    y = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    skip, nw, eps = norm if norm is not None else (None, x2, 0.0)
    skip2 = skip.reshape(-1, k).contiguous() if skip is not None else None
    total = torch.empty_like(x2) if skip2 is not None else None
    zmode = 0 if zero_points is None else (1 if zero_points.dtype == torch.uint8 else 2)
    if scheme is None:
        scheme = 0 if x.dtype == torch.float32 else 1
    even = (nb * block // 8) % bk8 == 0 and n % block_n == 0 and k % block == 0
    int4_gemv_kernel[(triton.cdiv(n, block_n), x2.shape[0])](
        x2,
        words,
        scales,
        scales if zero_points is None else zero_points,
        y,
        x2 if skip2 is None else skip2,
        nw,
        x2 if total is None else total,
        eps,
        residual_rows(residual, x2.shape[0], n, y),
        k,
        n,
        ld,
        nb,
        x2.stride(0),
        y.stride(0),
        0x3F800000,
        BLOCK=block,
        BLOCK_N=block_n,
        BK8=bk8,
        ZP=zmode,
        EVEN=even,
        SCHEME=scheme,
        SILU=silu,
        NORM=norm is not None,
        HAS_SKIP=skip2 is not None,
        HAS_RES=residual is not None,
        num_warps=warps,
        **launch_options(x),
    )
    out = y.reshape(*x.shape[:-1], n)
    if norm is None:
        return out
    return out, (None if total is None else total.reshape(x.shape))


@triton.jit
def _word_tile(W, S, Z, rw, rn, m, N, BLOCK: tl.constexpr, ZP: tl.constexpr):
    """The K-major words of word rows `rw` x columns `rn` (`m`: which exist) with each word row's block's
    scales (float32) and zero points (8.0 without them): what `_nibble_values` expands."""
    w = tl.load(W + rw[:, None].to(tl.int64) * N + rn[None, :], mask=m, other=0)
    at = (rw * 8 // BLOCK)[:, None].to(tl.int64) * N + rn[None, :]
    s = tl.load(S + at, mask=m, other=0.0).to(tl.float32)
    if ZP == 0:
        z = 8.0
    else:
        z = tl.load(Z + at, mask=m, other=0).to(tl.float32)
    return w, s, z


@triton.jit
def _nibble_values(w, s, z, t: tl.constexpr):
    """Row `8 r + t` of the dense weight from `_word_tile`'s word row r: `(q - z) * s` in float32."""
    return (((w >> (4 * t)) & 15).to(tl.float32) - z) * s


@triton.jit
def int4_dequant_kernel(
    W, S, Z, OUT, K, N, KW, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BK8: tl.constexpr, ZP: tl.constexpr
):
    """OUT[k, c] = (q(k, c) - z) * s for the K-major words `W` `[KW, N]`, scales and zero points
    `[n_blocks, N]`: program (i, j) expands word rows `i * BK8 ..` of columns `j * BLOCK_N ..`, nibble `t`
    of each word to row `8 r + t` (rows past K are padding and not stored)."""
    rw = tl.program_id(0) * BK8 + tl.arange(0, BK8)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = (rn < N)[None, :]
    w, s, z = _word_tile(W, S, Z, rw, rn, (rw < KW)[:, None] & nmask, N, BLOCK, ZP)
    for t in tl.static_range(8):
        row = rw * 8 + t
        tl.store(
            OUT + row[:, None].to(tl.int64) * N + rn[None, :],
            _nibble_values(w, s, z, t).to(OUT.dtype.element_ty),
            mask=(row < K)[:, None] & nmask,
        )


def int4_dequant(
    words: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    k: int,
    n: int,
    block: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The K-major tensors of `ops.quant.kmajor` (`n` columns: 2N for a merged gate/up) -> the dense weight
    `[K, n]` in `dtype`: `ops.quant.dequant_kmajor`'s values (computed in float32, rounded once), transposed."""
    assert words.dtype == torch.int32 and block % 8 == 0 and words.shape[1] == n
    out = torch.empty((k, n), dtype=dtype, device=words.device)
    zmode = 0 if zero_points is None else 1
    bk8, bn = 32, 64
    int4_dequant_kernel[(triton.cdiv(words.shape[0], bk8), triton.cdiv(n, bn))](
        words,
        scales,
        scales if zero_points is None else zero_points,
        out,
        k,
        n,
        words.shape[0],
        BLOCK=block,
        BLOCK_N=bn,
        BK8=bk8,
        ZP=zmode,
        num_warps=4,
    )
    return out
