"""Torch references of the fused kernels: the CPU path and the ground truth of the kernel tests."""

from __future__ import annotations

from typing import Any

import torch


def rms_norm_ref(
    x: torch.Tensor, skip: torch.Tensor | None, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, Any]:
    """`norms.rms_norm`'s values: `(y, x + skip)` (None without skip)."""
    # NOTE: as onnxruntime's SkipSimplifiedLayerNormalization: the sum is formed in float32 and
    # normalised unrounded; only the outputs (y and the residual sum) are rounded to x's dtype.
    sf = x.float() + skip.float() if skip is not None else x.float()
    y = (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)
    return y, (sf.to(x.dtype) if skip is not None else None)


def softmax_with_sink(scores: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis of float32 `scores`; with `sink` (broadcast to `scores[..., :1]`) one more
    logit in the denominator (onnxruntime's GroupQueryAttention head_sink, gpt-oss's attention sinks), whose
    probability is dropped."""
    if sink is None:
        return torch.softmax(scores, dim=-1)
    col = sink.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, col], dim=-1), dim=-1)[..., :-1]


def cache_attention_ref(
    q: torch.Tensor,
    kbuf: torch.Tensor,
    vbuf: torch.Tensor,
    past: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
    window: int = -1,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Static-shape reference: scores over the whole capacity, masked on the device (see
    `attention.cache_attention`)."""
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
    p = softmax_with_sink(s, sink.view(-1, 1, 1) if sink is not None else None)
    return torch.matmul(p, v).to(q.dtype)


def decode_advance_ref(
    top: torch.Tensor,
    wide: torch.Tensor,
    narrow: torch.Tensor,
    toks: torch.Tensor,
    batch: int,
    max_pages: int,
    page: int,
) -> None:
    """The torch reference of `advance.decode_advance` (the CPU path, tests)."""
    b = batch
    cnt, live = int(wide[4 * b]), int(wide[4 * b + 1])
    toks[cnt % toks.shape[0], :live] = top[:live]
    wide[:live] = top[:live]
    pos = wide[b : b + live] + 1
    wide[b : b + live] = pos
    table = narrow[b : b * (1 + max_pages)].view(b, max_pages)[:live]
    pages = table.gather(1, (pos // page).clamp(max=max_pages - 1).view(-1, 1).to(torch.int64)).view(-1)
    wide[2 * b : 2 * b + live] = pages.to(torch.int64) * page + pos % page
    narrow[:live] = (pos + 1).to(narrow.dtype)
    wide[4 * b] = cnt + 1
