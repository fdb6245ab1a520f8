"""CpuLayer: a decoder layer the lowering fused for the CPU's C kernels (`_fuse_cpu_layers`): the five ops of a
pre-norm layer with packed QKV, rotary GroupQueryAttention and a SiLU-gated MLP

    RmsLinear (norm + QKV)  ->  GroupQueryAttention  ->  Linear (output + residual)
    ->  RmsLinear (norm + gate/up + SiLU)  ->  Linear (down + residual)

run as one C call (`kernels.cpu.ops.Layer`) for decode and verify steps, or as the five ops (their own
builders, in order) for anything else: prefill chunks, and steps whose tensors the kernels do not take. The
node keeps the five as `_parts`; its inputs are theirs from outside the layer, its one output the last's."""

from __future__ import annotations

import math
from typing import Any

from onnxgen.backends.native.kernels.cpu import ops as cpu_kernels
from onnxgen.backends.native.ops.attention import BUILDERS as ATTENTION
from onnxgen.backends.native.ops.base import INTERNAL, Builder, Fn, Node, RunCtx
from onnxgen.backends.native.ops.linear import BUILDERS as LINEAR
from onnxgen.backends.native.ops.rotary import rope_rows

_PARTS = {**LINEAR, **ATTENTION}  # the builders of the ops a fused layer holds

_UNMADE = object()


def _cpu_layer(node: Node) -> Fn:
    parts: list[Node] = node.attrs["_parts"]
    a, b, c, d, e = parts
    fns = [_PARTS[(p.domain, p.op)](p) for p in parts]
    names = node.inputs
    layer = b.layer
    assert layer is not None
    heads = tuple(a.attr("_rope")[1:])  # (query heads, KV heads, head size)
    switch = b.attr("_rope_switch")
    fused: list[Any] = [_UNMADE]  # the kernels' Layer, made at the first call (the constants come as inputs)

    def make(vals: dict[str, Any]) -> cpu_kernels.Layer | None:
        sink = vals.get(b.inputs[11]) if len(b.inputs) > 11 and b.inputs[11] else None
        return cpu_kernels.Layer.make(
            nw1=vals[a.inputs[2]],
            eps1=float(a.attr("epsilon", 1e-5)),
            wqkv=vals[a.inputs[3]],
            wo=vals[c.inputs[1]],
            nw2=vals[d.inputs[2]],
            eps2=float(d.attr("epsilon", 1e-5)),
            wgu=vals[d.inputs[3]],
            wdown=vals[e.inputs[1]],
            heads=heads,  # type: ignore[arg-type]
            cos_c=vals[b.inputs[7]],
            sin_c=vals[b.inputs[8]],
            interleaved=bool(b.attr("rotary_interleaved", 0)),
            scale=float(b.attr("scale", 0.0) or 0.0) or 1.0 / math.sqrt(heads[2]),  # as GroupQueryAttention's
            softcap=float(b.attr("softcap", 0.0) or 0.0),
            window=int(b.attr("local_window_size", -1)),
            sink=None if sink is None else sink.reshape(-1).float().contiguous(),
        )

    def fast(ctx: RunCtx, x: Any, lay: cpu_kernels.Layer) -> Any:
        if ctx.paged is not None:
            if cpu_kernels.most_tokens(ctx.paged) > cpu_kernels.QUERY_TOKENS:
                return None
            return lay.run_paged(x, rope_rows(ctx, switch), ctx.paged, layer)
        if ctx.static or ctx.positions is None or ctx.n > cpu_kernels.QUERY_TOKENS:
            return None
        return lay.run_buffer(
            x, rope_rows(ctx, switch), ctx.positions, ctx.kv.keys[layer], ctx.kv.values[layer]
        )

    def f(ctx: RunCtx, *args: Any) -> tuple[Any, ...]:
        vals = dict(zip(names, args, strict=False))
        if fused[0] is _UNMADE:
            fused[0] = make(vals)
        if fused[0] is not None and ctx is not None and ctx.kv is not None:
            out = fast(ctx, vals[a.inputs[0]], fused[0])
            if out is not None:
                return (out,)
        for p, fn in zip(parts, fns, strict=True):
            res = fn(ctx, *[vals.get(i) if i else None for i in p.inputs])
            for o, v in zip(p.outputs, res, strict=False):
                if o:
                    vals[o] = v
        return (vals[e.outputs[0]],)

    return f


BUILDERS: dict[tuple[str, str], Builder] = {(INTERNAL, "CpuLayer"): _cpu_layer}
