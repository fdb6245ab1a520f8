"""Control flow: ai.onnx `If` whose branches are constant, lowered to `IfConst` (a choice between precomputed
values by a condition computed at run time).

The lowering (`lowering._lower_if`) evaluates both branches of every `If` once at load (each must compute
from constants only: Constant nodes, initializers, constants of the outer graph; anything else is rejected
with `UnsupportedOp` naming the node that reads a run-time value) and replaces the node by
`IfConst(cond, then_0 .. then_k-1, else_0 .. else_k-1)`. LongRoPE's switch between short and long rotary
tables, the builder's one use of `If`, is rewritten further (`lowering._rope_switch`): no `IfConst` is left,
the attention reads one table of both and each token its own row (`ops.rotary.rope_rows`).
"""

from __future__ import annotations

from typing import Any

import torch

from onnxgen.backends.native.ops.base import AI, INTERNAL, Builder, Fn, Node, forbid_static, same_device
from onnxgen.errors import UnsupportedOp


def _if(node: Node) -> Fn:
    """ai.onnx If: never built as it is (the lowering turns every `If` into `IfConst` or rejects it)."""
    raise UnsupportedOp("If(branches not lowered)", "", node.name, ["IfConst"])


def _if_const(node: Node) -> Fn:
    """`IfConst(cond, then..., else...)`: the then-values when `cond` is true, else the else-values. A host
    condition picks (no copy); a device condition selects on the device (`torch.where`, no host sync: it can be
    captured) when the two values of an output have one shape, and otherwise reads the condition (eager steps
    only: a static step raises `NotCapturable`)."""
    k = len(node.outputs)

    def f(ctx: Any, cond: Any, *values: Any) -> tuple[Any, ...]:
        then, other = values[:k], values[k:]
        if cond.device.type == "cpu":
            return tuple(then if bool(cond.reshape(-1)[0]) else other)
        c = cond.reshape(()).bool()
        if all(a.shape == b.shape for a, b in zip(then, other, strict=True)):
            out = []
            for a, b in zip(then, other, strict=True):
                a, b, cc = same_device(ctx, a, b, c)
                out.append(torch.where(cc, a, b))
            return tuple(out)
        forbid_static(ctx, "If whose branches differ in shape, on a device condition")
        return tuple(then if bool(c) else other)

    return f


BUILDERS: dict[tuple[str, str], Builder] = {
    (AI, "If"): _if,
    (INTERNAL, "IfConst"): _if_const,
}
