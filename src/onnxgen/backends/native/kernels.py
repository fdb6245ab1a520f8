"""Fused kernels for the native backend: Triton on CUDA, plain torch elsewhere.

Each public function has one torch reference implementation (used on the CPU and as the ground truth
in tests) and, when the tensors live on a CUDA device and Triton imports, a Triton kernel:

- `rms_norm(x, skip, w, eps)`: (skip-)RMSNorm in one pass, returning `(y, x + skip)`.
- `silu_mul(g, u)`: `silu(g) * u`.
- `cache_attention(q, kbuf, vbuf, past, ...)`: M query tokens at positions `past .. past + M - 1`
  against a KV buffer that already holds their keys, causal (query t sees keys `[0, past + t]`), with
  the length read from device memory: static shapes over a fixed capacity, so decode (M = 1) and
  prefill chunks alike can live in a CUDA graph. Split-K ("flash decoding") over the keys, the query
  heads that share a KV head packed into one tile; only the valid KV is read.
- `rope_qkv_write(qkv, cos, sin, positions, kv, layer, ...)`: split packed QKV rows, rotate q and k,
  write k and v into the KV buffers at `positions` and return q.

`FORCE_TRITON` (tests) runs the Triton kernels on CPU tensors under `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

FORCE_TRITON = os.environ.get("ONNXGEN_FORCE_TRITON") == "1"
DISABLE_TRITON = os.environ.get("ONNXGEN_NO_TRITON") == "1"
_TRITON: Any = None
_TRITON_OK: bool | None = None


def _use_triton(t: torch.Tensor) -> bool:
    global _TRITON_OK
    if DISABLE_TRITON or not (t.is_cuda or FORCE_TRITON):
        return False
    if _TRITON_OK is None:
        try:
            _build()
            _TRITON_OK = True
        except Exception:  # triton missing or broken: torch path
            _TRITON_OK = False
    return bool(_TRITON_OK)


def triton_available() -> bool:
    return _use_triton(torch.empty(0, device="cuda")) if torch.cuda.is_available() else False


# --- torch references ----------------------------------------------------------------------------


def rms_norm_ref(
    x: torch.Tensor, skip: torch.Tensor | None, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, Any]:
    s = x + skip if skip is not None else x
    sf = s.float()
    y = (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w
    return y, (s if skip is not None else None)


def cache_attention_ref(q: torch.Tensor, kbuf: torch.Tensor, vbuf: torch.Tensor, past: torch.Tensor,
                        scale: float, softcap: float = 0.0, window: int = -1) -> torch.Tensor:  # fmt: skip
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
    if not _use_triton(x) or not x.is_contiguous() or (skip is not None and not skip.is_contiguous()):
        return rms_norm_ref(x, skip, w, eps)
    tl_k = _TRITON
    n = x.shape[-1]
    rows = x.numel() // n
    y = torch.empty_like(x)
    s = torch.empty_like(x) if skip is not None else x
    block = max(16, 1 << (n - 1).bit_length())
    tl_k["rms"][(rows,)](
        x, skip if skip is not None else x, w, y, s, n, eps,
        HAS_SKIP=skip is not None, BLOCK=block, num_warps=8 if block >= 4096 else 4,
    )  # fmt: skip
    return y, (s if skip is not None else None)


def silu_mul(g: torch.Tensor, u: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`silu(g) * u`. With `out=g` the result overwrites `g` (callers guarantee nobody else reads it)."""
    if not _use_triton(g) or g.shape != u.shape or not (g.is_contiguous() and u.is_contiguous()):
        if out is g and g.shape == torch.broadcast_shapes(g.shape, u.shape):
            return F.silu(g, inplace=True).mul_(u)
        return F.silu(g) * u
    if out is None:
        out = torch.empty_like(g)
    n = g.numel()
    block = 2048
    _TRITON["silu_mul"][(triton_cdiv(n, block),)](g, u, out, n, BLOCK=block, num_warps=4)
    return out


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def cache_attention(q: torch.Tensor, kbuf: torch.Tensor, vbuf: torch.Tensor, past: torch.Tensor,
                    scale: float, softcap: float = 0.0, window: int = -1,
                    config: tuple[int, int, int] | None = None) -> torch.Tensor:  # fmt: skip
    """Attention of M new tokens over a KV buffer that already holds their keys and values.

    `q` `[1, N, M, D]` (contiguous): queries at absolute positions `past .. past + M - 1`; `kbuf`/`vbuf`
    `[1, Hkv, cap, D]` valid at `[0, past + M)`; `past` `[1]` integer on the device. Query t sees keys
    `[0, past + t]` (with `window` > 0 only the last `window` of them); scores are soft-capped when
    `softcap` > 0. Returns `[1, N, M, D]` in q's dtype. Shapes depend only on M and the capacity.
    `config` (benchmarks): (rows per program, warps, pipeline stages) instead of the defaults."""
    if not _use_triton(q):
        return cache_attention_ref(q, kbuf, vbuf, past, scale, softcap, window)
    n, m, d = q.shape[1], q.shape[2], q.shape[3]
    hkv, cap = kbuf.shape[1], kbuf.shape[2]
    g = n // hkv
    rows = g * m  # per KV head: its G query heads x M tokens, contiguous in q
    dp = max(16, 1 << (d - 1).bit_length())
    block_m = min(64, max(16, 1 << (rows - 1).bit_length()))
    warps, stages = 4, 2
    if config is not None:
        block_m, warps, stages = config
    block_n = 64 if dp <= 128 else 32
    rblocks = triton_cdiv(rows, block_m)
    rp = rblocks * block_m
    # Split the keys so that about 2 waves of programs run (decode: up to 64 splits of >= 256 keys).
    want = 64 if m == 1 else triton_cdiv(256, hkv * rblocks)
    nsplit = max(1, min(want, cap // 256))
    split = max(block_n, triton_cdiv(triton_cdiv(cap, nsplit), block_n) * block_n)
    nsplit = triton_cdiv(cap, split)
    qc = q.contiguous()
    out = torch.empty_like(qc)
    direct = nsplit == 1
    acc = qc if direct else torch.empty((hkv, nsplit, rp, dp), dtype=torch.float32, device=q.device)
    ml = qc if direct else torch.empty((2, hkv, nsplit, rp), dtype=torch.float32, device=q.device)
    k_ = _TRITON
    k_["attn_split"][(hkv, rblocks, nsplit)](
        qc, kbuf, vbuf, past, acc, ml, out, kbuf.stride(1), kbuf.stride(2), vbuf.stride(1), vbuf.stride(2),
        float(scale), float(softcap), int(window), m, rows, rp, hkv * nsplit * rp, split,
        D=d, DP=dp, BLOCK_M=block_m, BLOCK_N=block_n, NSPLIT=nsplit, SOFTCAP=softcap > 0,
        IEEE=q.dtype == torch.float32, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if not direct:
        k_["attn_combine"][(n * m,)](
            acc, ml, out, rows, rp, hkv * nsplit * rp, D=d, DP=dp, NSPLIT=nsplit,
            NSP=max(2, 1 << (nsplit - 1).bit_length()), num_warps=4,
        )  # fmt: skip
    return out


def rope_qkv_write(qkv: torch.Tensor, cos_c: torch.Tensor, sin_c: torch.Tensor, positions: torch.Tensor,
                   kv: Any, layer: int, n: int, hkv: int, d: int, interleaved: bool) -> torch.Tensor:  # fmt: skip
    """Packed QKV of S tokens `[1, S, (n + 2*hkv) * d]` -> rotated q `[1, n, S, d]`; rotated k and v are
    written into `kv.keys[layer]` / `kv.values[layer]` at `positions` (`[S]` int64 on the device).
    One kernel launch on CUDA (decode and prefill alike)."""
    kb, vb = kv.keys[layer], kv.values[layer]
    s = qkv.shape[1]
    if not _use_triton(qkv):
        from onnxgen.backends.native.ops import rope

        q = qkv[..., : n * d].reshape(1, s, n, d)
        k = qkv[..., n * d : (n + hkv) * d].reshape(1, s, hkv, d)
        v = qkv[..., (n + hkv) * d :].reshape(1, s, hkv, d)
        cos = cos_c.index_select(0, positions).unsqueeze(1)
        sin = sin_c.index_select(0, positions).unsqueeze(1)
        q, k = rope(q, cos, sin, interleaved), rope(k, cos, sin, interleaved)
        kv.write_at(layer, positions, k.transpose(1, 2), v.transpose(1, 2))
        return q.transpose(1, 2).contiguous()
    qkv = qkv.contiguous()
    qout = torch.empty((1, n, s, d), dtype=qkv.dtype, device=qkv.device)
    half = cos_c.shape[1]
    _TRITON["rope_qkv"][(n + 2 * hkv, s)](
        qkv, cos_c, sin_c, positions, qout, kb, vb, kb.stride(1), kb.stride(2), vb.stride(1), vb.stride(2),
        cos_c.stride(0), n, hkv, (n + 2 * hkv) * d, s, D=d, HALF=half, DP=max(16, 1 << (d - 1).bit_length()),
        INTERLEAVED=interleaved, num_warps=1,
    )  # fmt: skip
    return qout


# --- Triton kernels (built on first use) -------------------------------------------------------------


def _build() -> None:
    global _TRITON
    if _TRITON is not None:
        return
    import triton
    import triton.language as tl

    @triton.jit
    def _rms(X, S, W, Y, SUM, N, eps, HAS_SKIP: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        x = tl.load(X + row * N + cols, mask=m, other=0.0)
        if HAS_SKIP:
            x = x + tl.load(S + row * N + cols, mask=m, other=0.0)
            tl.store(SUM + row * N + cols, x, mask=m)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / N
        y = (xf * (1.0 / tl.sqrt(var + eps))).to(X.dtype.element_ty)
        w = tl.load(W + cols, mask=m, other=0.0)
        tl.store(Y + row * N + cols, (y * w).to(X.dtype.element_ty), mask=m)

    @triton.jit
    def _silu_mul(G, U, OUT, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        g = tl.load(G + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=m, other=0.0)
        s = (g / (1.0 + tl.exp(-g))).to(U.dtype.element_ty)
        tl.store(OUT + offs, (s * u).to(U.dtype.element_ty), mask=m)

    @triton.jit
    def _attn_split(Q, K, V, PAST, ACC, ML, OUT, sk_h, sk_s, sv_h, sv_s, scale, softcap, window, M, R, RP,
                    ML_STRIDE, SPLIT, D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, NSPLIT: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
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
        base_n = sp * SPLIT
        hi = tl.minimum(base_n + SPLIT, tl.max(tl.where(rmask, limit, 0), 0))
        lo = base_n
        if window > 0:
            lo = tl.maximum(base_n, tl.min(tl.where(rmask, limit, 1 << 30), 0) - window)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DP], tl.float32)
        kbase = K + h.to(tl.int64) * sk_h
        vbase = V + h.to(tl.int64) * sv_h
        for start in range(lo, hi, BLOCK_N):
            offs = start + tl.arange(0, BLOCK_N)
            nm = offs < hi
            k = tl.load(
                kbase + offs[:, None].to(tl.int64) * sk_s + dcol[None, :],
                mask=nm[:, None] & dmask[None, :],
                other=0.0,
            )
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k)) * scale
            if SOFTCAP:
                s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0)
            keep = nm[None, :] & (offs[None, :] < limit[:, None])
            if window > 0:
                keep = keep & (offs[None, :] >= limit[:, None] - window)
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                vbase + offs[:, None].to(tl.int64) * sv_s + dcol[None, :],
                mask=nm[:, None] & dmask[None, :],
                other=0.0,
            )
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if NSPLIT == 1:  # one split: normalise and write the output here
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(OUT + qrow[:, None] * D + dcol[None, :], o.to(OUT.dtype.element_ty),
                     mask=rmask[:, None] & dmask[None, :])  # fmt: skip
        else:
            base = (h * NSPLIT + sp) * RP
            tl.store(ACC + (base + rows)[:, None].to(tl.int64) * DP + dcol[None, :], acc)
            tl.store(ML + base + rows, m_i)
            tl.store(ML + ML_STRIDE + base + rows, l_i)

    @triton.jit
    def _attn_combine(ACC, ML, OUT, R, RP, ML_STRIDE, D: tl.constexpr, DP: tl.constexpr, NSPLIT: tl.constexpr,
                      NSP: tl.constexpr):  # fmt: skip
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
        w = tl.where(smask & (m > float("-inf")), tl.exp(m - mx), 0.0)
        den = tl.sum(w * lsum, 0)
        acc = tl.load(ACC + idx[:, None].to(tl.int64) * DP + dcol[None, :], mask=smask[:, None], other=0.0)
        o = tl.sum(acc * w[:, None], 0) / den
        tl.store(OUT + row.to(tl.int64) * D + dcol, o.to(OUT.dtype.element_ty), mask=dcol < D)

    @triton.jit
    def _rope_qkv(QKV, COS, SIN, POS, QO, KB, VB, sk_h, sk_s, sv_h, sv_s, cos_stride, N, HKV, ROW, S,
                  D: tl.constexpr, HALF: tl.constexpr, DP: tl.constexpr, INTERLEAVED: tl.constexpr):  # fmt: skip
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
        c = tl.load(COS + pos * cos_stride + fi, mask=mj & rot, other=1.0).to(tl.float32)
        s = tl.load(SIN + pos * cos_stride + fi, mask=mj & rot, other=0.0).to(tl.float32)
        o = tl.where(rot, x * c + sign * xp * s, x).to(QO.dtype.element_ty)
        tl.store(QO + (hh * S + t).to(tl.int64) * D + j, o, mask=mj & (hh < N))
        kh = tl.minimum(tl.maximum(hh - N, 0), HKV - 1).to(tl.int64)
        tl.store(KB + kh * sk_h + pos * sk_s + j, o, mask=mj & (hh >= N) & (hh < N + HKV))
        vh = tl.minimum(tl.maximum(hh - N - HKV, 0), HKV - 1).to(tl.int64)
        tl.store(VB + vh * sv_h + pos * sv_s + j, o, mask=mj & (hh >= N + HKV))

    _TRITON = {"rms": _rms, "silu_mul": _silu_mul, "attn_split": _attn_split, "attn_combine": _attn_combine,
               "rope_qkv": _rope_qkv}  # fmt: skip
