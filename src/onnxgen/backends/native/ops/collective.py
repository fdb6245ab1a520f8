"""Collectives across the ranks of a tensor-parallel group (`backends/native/tp`): `AllReduce`, the partial
sums of a row-parallel product added across ranks, in place. Only the sharding pass (`tp.shard`) writes these
nodes; the node's `_comm` attribute is the group they run over (`tp.comm.Comm`)."""

from __future__ import annotations

from typing import Any

from onnxgen.backends.native.ops.base import INTERNAL, Builder, Fn, Node


def _all_reduce(node: Node) -> Fn:
    """`AllReduce(x)`: every rank's `x` summed, in place (the input is the product's own output, read by
    nothing else)."""
    comm = node.attr("_comm")
    assert comm is not None, f"{node.name}: AllReduce without its group"

    def f(ctx: Any, x: Any) -> tuple[Any, ...]:
        return (comm.all_reduce(x),)

    return f


BUILDERS: dict[tuple[str, str], Builder] = {
    (INTERNAL, "AllReduce"): _all_reduce,
}
