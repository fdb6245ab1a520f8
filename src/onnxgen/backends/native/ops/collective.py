"""Collectives across the ranks of a tensor-parallel group (`backends/native/tp`): `AllReduce`, the partial
sums of a row-parallel product added across ranks, in place; `AllGather`, each rank's slice of the last axis
(the vocab-parallel lm_head's logits) joined into the whole on every rank. Only the sharding pass
(`tp.shard`) writes these nodes; the node's `_comm` attribute is the group they run over (`tp.comm.Comm`)."""

from __future__ import annotations

from typing import Any

import torch

from onnxgen.backends.native.ops.base import INTERNAL, Builder, Fn, Node


def _all_reduce(node: Node) -> Fn:
    """`AllReduce(x)`: every rank's `x` summed, in place (the input is the product's own output, read by
    nothing else)."""
    comm = node.attr("_comm")
    assert comm is not None, f"{node.name}: AllReduce without its group"

    def f(ctx: Any, x: Any) -> tuple[Any, ...]:
        return (comm.all_reduce(x),)

    return f


def _all_gather(node: Node) -> Fn:
    """`AllGather(x)`: rank r's `x` is features `[sum(sizes[:r]), sum(sizes[:r + 1]))` of the last axis (the
    `sizes` attribute: every rank's width, uneven allowed); the result, on every rank, is all of them in rank
    order. One collective: each part padded to the widest, gathered, the padding dropped."""
    comm = node.attr("_comm")
    sizes = [int(s) for s in node.attr("sizes")]
    assert comm is not None and sizes, f"{node.name}: AllGather without its group or sizes"
    widest = max(sizes)

    def f(ctx: Any, x: Any) -> tuple[Any, ...]:
        if x.shape[-1] < widest:
            x = torch.nn.functional.pad(x, (0, widest - x.shape[-1]))
        parts = comm.all_gather(x)  # [world, ..., widest]
        if all(s == widest for s in sizes):
            return (parts.movedim(0, -2).reshape(*x.shape[:-1], widest * len(sizes)),)
        return (torch.cat([parts[r, ..., :s] for r, s in enumerate(sizes)], dim=-1),)

    return f


BUILDERS: dict[tuple[str, str], Builder] = {
    (INTERNAL, "AllReduce"): _all_reduce,
    (INTERNAL, "AllGather"): _all_gather,
}
