"""The float64 reference the paged attention kernels are held to: each sequence of a batch step on its own,
its keys and values copied out of the pool position by position (only the positions its window can see, so a
poisoned page outside every window is never read), attention with an explicit causal/window mask, optional
soft-capping and a sink logit per query head in the softmax's denominator (gpt-oss's attention sinks)."""

from __future__ import annotations

import torch

from onnxgen.backends.batch import BatchStep
from onnxgen.kv.storage import PageStorage


def softmax_with_sink(scores: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """float64 softmax over the last axis, a sink logit per head (axis 0) in the denominator."""
    if sink is None:
        return torch.softmax(scores, -1)
    col = sink.double().cpu().view(-1, *([1] * (scores.dim() - 1))).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, col], -1), -1)[..., :-1]


def dense_attention(
    st: PageStorage,
    step: BatchStep,
    q: torch.Tensor,
    layer: int,
    scale: float,
    window: int,
    softcap: float = 0.0,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[tokens, heads, D]` float64 on the CPU for `q` (`[tokens, heads, D]`, the step's tokens in order);
    `window` <= 0: no window; `softcap` <= 0: no capping. Heads share KV heads in groups of heads / kv heads."""
    page = st.page_size
    out, t0 = [], 0
    for s in step.seqs:
        m = len(s.tokens)
        lo = max(0, s.start - window + 1) if window > 0 else 0
        pos = range(lo, s.end)
        k = torch.stack([st.keys(layer)[s.pages[p // page], p % page] for p in pos], 1).double().cpu()
        v = torch.stack([st.values(layer)[s.pages[p // page], p % page] for p in pos], 1).double().cpu()
        group = q.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        qi = q[t0 : t0 + m].transpose(0, 1).double().cpu()
        qpos = torch.arange(s.start, s.end).unsqueeze(1)
        kpos = torch.tensor(list(pos)).unsqueeze(0)
        keep = (kpos <= qpos) & ((kpos > qpos - window) if window > 0 else True)
        sc = qi @ k.transpose(-1, -2) * scale
        if softcap > 0:
            sc = softcap * torch.tanh(sc / softcap)
        sc = sc.masked_fill(~keep, float("-inf"))
        out.append((softmax_with_sink(sc, sink) @ v).transpose(0, 1))
        t0 += m
    return torch.cat(out)
