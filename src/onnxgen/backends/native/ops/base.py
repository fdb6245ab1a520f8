"""What every op family shares: the lowered `Node`, the per-forward `RunCtx`, and the host/device rules.

Values are torch tensors; "host" values (shape arithmetic, small integer constants) are CPU tensors and
stay on the CPU as long as every input of an op is on the CPU, so `Shape -> Gather -> Concat -> Reshape`
chains never touch the device. When an op mixes host and device inputs, the host ones are moved to the
device (never during a static-shape step, where that raises `NotCapturable` so the decoder falls back to
eager execution). A static step (decode, or a prefill chunk padded to a bucket) reads its start
position, positions and last real token from device memory, so one captured CUDA graph serves every
position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from onnxgen.errors import NotCapturable

Fn = Callable[..., tuple[Any, ...]]  # fn(ctx, *inputs) -> outputs; ctx is None when folding constants
AI = ""  # the ai.onnx domain
MS = "com.microsoft"
INTERNAL = "onnxgen"  # ops the lowering produces (fusions, bound KV); not in `supported_ops()`


@dataclass
class Node:
    op: str
    domain: str
    name: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    layer: int | None = None  # KV layer bound to this node (attention / KV concat)
    kv_role: str | None = None  # "key" / "value" for a bound Concat

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)


Builder = Callable[[Node], Fn]


class RunCtx:
    """Per-forward state the ops read: KV buffers, positions, and whether the step is static."""

    def __init__(
        self,
        kv: Any,
        pos0: int,
        n: int,
        positions: torch.Tensor | None,
        *,
        past: torch.Tensor | None = None,
        last: torch.Tensor | None = None,
        paged: Any = None,
        static: bool | None = None,
        rowwise: bool = False,
        totals: Any = None,
    ) -> None:
        self.kv = kv
        self.pos0 = pos0  # KV length before this forward (host int; -1 when static or paged)
        self.n = n  # tokens in this forward (static: the bucket size, padding included)
        self.positions = positions  # [n] int64 on the device: pos0 + arange(n) (paged: each token's own)
        self.past = past  # static only: [1] int64 on the device, the KV length before this forward
        # int64 on the device: the tokens whose logits are wanted, in increasing order, each once (None: the
        # last); as many as the step's tokens means every token's (a captured verify step's padding rows
        # repeat its last real row there: their logits are never read)
        self.last = last
        self.paged = paged  # a ragged batch over the paged pool (`native.paged.PagedStep`), or None
        self.static = past is not None if static is None else static  # static shapes: a graph can capture it
        # every token computed exactly as a one-token step computes it (a verify step: the rowwise products of
        # `kernels.linear` and `paged.attention`'s per-token work), so its rows equal plain decoding's bits
        self.rowwise = rowwise
        # each token's sequence length as the graph sees it (its attention mask's width, which LongRoPE's switch
        # reads; `ops.rotary.rope_rows`): a host int (one sequence), an int tensor on the device (`[1]`, or one
        # per token: `[n]`), or None: derived (contiguous steps: pos0 + n, or past + last + 1 when static;
        # paged steps must set it)
        self.totals = totals
        self.memo: dict[Any, Any] = {}  # values computed once per forward and shared by the ops (rotary rows)
        self.prepared: set[int] = set()  # layers whose QKV product rotated q, k and wrote k, v (`_qkv_rope`)


def is_rowwise(ctx: RunCtx | None) -> bool:
    """Whether each row of the step must be computed as a one-row (decode) step would (`RunCtx.rowwise`)."""
    return bool(ctx is not None and ctx.rowwise)


def forbid_static(ctx: RunCtx | None, why: str) -> None:
    """Raise `NotCapturable(why)` in a static step (the decoder then runs the forward eagerly)."""
    if ctx is not None and ctx.static:
        raise NotCapturable(why)


def same_device(ctx: RunCtx | None, *xs: Any) -> list[Any]:
    """Move CPU (host) tensors to the device of the first non-CPU input."""
    dev = None
    for x in xs:
        if isinstance(x, torch.Tensor) and x.device.type != "cpu":
            dev = x.device
            break
    if dev is None:
        return list(xs)
    out = []
    for x in xs:
        if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() > 0:
            forbid_static(ctx, "host tensor used by a device op in a static step")
            x = x.to(dev)
        out.append(x)
    return out


def nonneg_axis(a: int, rank: int) -> int:
    return a + rank if a < 0 else a
