"""The op registry of the native backend: (domain, op) -> builder, one table per op family.

A builder takes a `Node` (op type, domain, attributes, input/output names) and returns a closure
`fn(ctx, *inputs) -> tuple(outputs)` over torch tensors (`base` states the host/device rules). The
families: `elementwise`, `tensor` (shapes, data movement, reductions), `linear`, `norms`, `rotary`,
`attention` (the ops bound to the runtime's KV), `quant` (int4: dequantization at load, or the
lowering's Int4Linear on packed weights), `moe` (mixture of experts: MoE, QMoE, their weights prepared at
load by `prepare_moe`), `control` (`If` with constant branches), `collective` (tensor parallelism's
all-reduce) and `cpu_layer` (a decoder layer fused for the CPU's C kernels).
"""

from __future__ import annotations

from onnxgen.backends.native.ops import (
    attention,
    collective,
    control,
    cpu_layer,
    elementwise,
    linear,
    moe,
    norms,
    quant,
    rotary,
    tensor,
)
from onnxgen.backends.native.ops.base import AI, INTERNAL, Builder, Fn, Node, RunCtx
from onnxgen.backends.native.ops.moe import prepare_moe
from onnxgen.backends.native.ops.quant import (
    dequant_gather_block,
    dequant_matmul_nbits,
    kmajor,
    trivial_g_idx,
)
from onnxgen.errors import UnsupportedOp

__all__ = [
    "BUILDERS",
    "Builder",
    "Fn",
    "Node",
    "RunCtx",
    "builder",
    "dequant_gather_block",
    "dequant_matmul_nbits",
    "kmajor",
    "prepare_moe",
    "supported_ops",
    "trivial_g_idx",
]

BUILDERS: dict[tuple[str, str], Builder] = {}
for _family in (
    elementwise,
    tensor,
    linear,
    norms,
    rotary,
    attention,
    quant,
    moe,
    control,
    collective,
    cpu_layer,
):
    _twice = BUILDERS.keys() & _family.BUILDERS.keys()
    assert not _twice, f"ops registered by two families: {sorted(_twice)}"
    BUILDERS.update(_family.BUILDERS)


def supported_ops() -> list[str]:
    """Public op names (domain-qualified for contrib ops) the native backend lowers."""
    out = []
    for dom, op in BUILDERS:
        if dom == INTERNAL:
            continue
        out.append(op if dom == AI else f"{dom}::{op}")
    return sorted(set(out))


def builder(node: Node) -> Builder:
    """The builder of `node`'s op. Raises `UnsupportedOp` (naming the op, its domain, the node and every
    supported op) when the native backend has none."""
    b = BUILDERS.get((node.domain, node.op))
    if b is None:
        raise UnsupportedOp(node.op, node.domain, node.name, supported_ops())
    return b
