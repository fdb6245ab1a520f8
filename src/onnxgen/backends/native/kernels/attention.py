"""Attention over a contiguous KV buffer (the batch-1 decoder's `KVBuffers`) and the rotary + KV write.

- `cache_attention(q, kbuf, vbuf, past, ...)`: M query tokens at positions `past .. past + M - 1` against a
  KV buffer that already holds their keys, causal (query t sees keys `[0, past + t]`), with the length read
  from device memory: static shapes over a fixed capacity, so decode (M = 1) and prefill chunks alike can live
  in a CUDA graph. Split-K ("flash decoding") over the keys, the query heads that share a KV head packed into
  one tile; only the valid KV is read (with a window, only the keys some query's window holds).
- `rope_qkv_write(qkv, cos, sin, positions, kv, layer, ...)`: split packed QKV rows, rotate q and k, write k
  and v into the KV buffers at `positions` (or slots: the paged pool's rows) and return q.

The paged pool's attention is `native.paged.attention`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from onnxgen.backends.native.kernels.cpu import ops as cpu_kernels
from onnxgen.backends.native.kernels.dispatch import KERNELS, launch_options, triton_cdiv, use_triton
from onnxgen.backends.native.kernels.reference import cache_attention_ref, rms_norm_ref
from onnxgen.backends.native.rotary import rope


class QKNorm(NamedTuple):
    """Per-head RMS norms of q and k before rotation: their weights (`[d]`, on the device) and epsilons."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    q_eps: float
    k_eps: float


_MAX_SPLITS = 64  # key splits per (KV head, row block); the combine pass reads this many slots, masked
_LOG2E = 1.4426950408889634  # the kernels keep scores in base 2 (exp2 is one instruction)


def cache_attention(
    q: torch.Tensor,
    kbuf: torch.Tensor,
    vbuf: torch.Tensor,
    past: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
    window: int = -1,
    sink: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Attention of M new tokens over a KV buffer that already holds their keys and values.

    `q` `[1, N, M, D]` (contiguous): queries at absolute positions `past .. past + M - 1`; `kbuf`/`vbuf`
    `[1, Hkv, cap, D]` valid at `[0, past + M)`; `past` `[1]` integer on the device. Query t sees keys
    `[0, past + t]` (with `window` > 0 only the last `window` of them); scores are soft-capped when
    `softcap` > 0; `sink` (`[N]` float32): a logit per head in the softmax's denominator. Returns `[1, N, M, D]`
    in q's dtype. Shapes depend only on M and the capacity.
    `config` (benchmarks): (rows per program, keys per block, warps, pipeline stages) instead of the
    defaults."""
    if not use_triton(q):
        return cache_attention_ref(q, kbuf, vbuf, past, scale, softcap, window, sink)
    # pragma: cuda-begin (Triton launch: CUDA, or the Triton interpreter)
    n, m, d = q.shape[1], q.shape[2], q.shape[3]
    hkv, cap = kbuf.shape[1], kbuf.shape[2]
    g = n // hkv
    rows = g * m  # per KV head: its G query heads x M tokens, contiguous in q
    dp = max(16, 1 << (d - 1).bit_length())
    # 64 x 64 tiles, 4 warps, 3 stages for prefill chunks (chosen against flash attention over an 8k cache);
    # decode rows are the query heads of one KV head. Few distinct
    # configurations = few Triton compiles.
    block_m = min(64, max(16, 1 << (rows - 1).bit_length()))
    block_n, warps, stages = (64 if dp <= 128 else 32), 4, (2 if m == 1 else 3)
    if config is not None:
        block_m, block_n, warps, stages = config
    rblocks = triton_cdiv(rows, block_m)
    rp = rblocks * block_m
    # Split the keys so that about 2 waves of programs run (decode: up to 64 splits of >= 256 keys).
    # The split count is a run-time argument (only "one split or several" is compiled in), so a new
    # KV capacity never triggers a Triton compile.
    # With a window the splits cut only the keys some row's window holds (from the first row's window start,
    # on the device): at most window + M - 1 of them, whatever the capacity.
    span = min(cap, window + m - 1) if window > 0 else cap
    want = 64 if m == 1 else triton_cdiv(256, hkv * rblocks)
    nsplit = max(1, min(want, span // 256, _MAX_SPLITS))
    split = max(block_n, triton_cdiv(triton_cdiv(span, nsplit), block_n) * block_n)
    nsplit = triton_cdiv(span, split)
    qc = q.contiguous()
    out = torch.empty_like(qc)
    direct = nsplit == 1
    acc = qc if direct else torch.empty((hkv, nsplit, rp, dp), dtype=torch.float32, device=q.device)
    ml = qc if direct else torch.empty((2, hkv, nsplit, rp), dtype=torch.float32, device=q.device)
    k_ = KERNELS
    k_["attn_split"][(hkv, rblocks, nsplit)](
        qc,
        kbuf,
        vbuf,
        past,
        acc,
        ml,
        out,
        sink if sink is not None else qc,
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
        SINK=sink is not None,
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
    qk_norm: QKNorm | None = None,
) -> torch.Tensor:
    """Packed QKV of S tokens `[1, S, (n + 2*hkv) * d]` -> rotated q `[1, n, S, d]` (rotated at `positions`,
    `[S]` int64 on the device); rotated k and v are written into `kv.keys[layer]` / `kv.values[layer]`
    (`[1, hkv, rows, d]`, any strides) at rows `slots` (default: `positions`). One kernel launch on CUDA
    (decode and prefill alike). `token_major`: q is a view of `[1, S, n, d]` storage (what the paged
    attention reads without a copy); otherwise contiguous. `qk_norm` (Gemma 3, Qwen 3): each q and k head
    RMS-normalised over `d` with its weight first, rounded to qkv's dtype, then rotated (the values of
    `rms_norm_ref` per head followed by `rope`)."""
    if slots is None:
        slots = positions
    kb, vb = kv.keys[layer], kv.values[layer]
    s = qkv.shape[1]
    if not use_triton(qkv):
        if qk_norm is None:  # float32 on the CPU: the C kernel
            q = cpu_kernels.rope_qkv_write(
                qkv, cos_c, sin_c, positions, kb, vb, n, hkv, d, interleaved, slots, token_major
            )
            if q is not None:
                return q
        v = qkv[..., (n + hkv) * d :].reshape(1, s, hkv, d)
        cos = cos_c.index_select(0, positions).unsqueeze(1)
        sin = sin_c.index_select(0, positions).unsqueeze(1)
        if qk_norm is None:  # q and k heads rotated together (the same values, half the torch calls)
            qk = rope(qkv[..., : (n + hkv) * d].reshape(1, s, n + hkv, d), cos, sin, interleaved)
            q, k = qk[:, :, :n], qk[:, :, n:]
        else:
            q = qkv[..., : n * d].reshape(1, s, n, d)
            k = qkv[..., n * d : (n + hkv) * d].reshape(1, s, hkv, d)
            q = rms_norm_ref(q, None, qk_norm.q_weight, qk_norm.q_eps)[0]
            k = rms_norm_ref(k, None, qk_norm.k_weight, qk_norm.k_eps)[0]
            q, k = rope(q, cos, sin, interleaved), rope(k, cos, sin, interleaved)
        kv.write_at(layer, slots, k.transpose(1, 2), v.transpose(1, 2))
        return q.contiguous().transpose(1, 2) if token_major else q.transpose(1, 2).contiguous()
    # pragma: cuda-begin (Triton launch: CUDA, or the Triton interpreter)
    qkv = qkv.contiguous()
    shape = (1, s, n, d) if token_major else (1, n, s, d)
    qout = torch.empty(shape, dtype=qkv.dtype, device=qkv.device)
    q = qout.transpose(1, 2) if token_major else qout  # [1, n, S, d] either way
    half = cos_c.shape[1]
    KERNELS["rope_qkv"][(n + 2 * hkv, s)](
        qkv,
        cos_c,
        sin_c,
        positions,
        slots,
        qk_norm.q_weight if qk_norm is not None else qkv,
        qk_norm.k_weight if qk_norm is not None else qkv,
        qk_norm.q_eps if qk_norm is not None else 0.0,
        qk_norm.k_eps if qk_norm is not None else 0.0,
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
        NORM=qk_norm is not None,
        num_warps=1,
        **launch_options(qkv),
    )
    return q
    # pragma: cuda-end
