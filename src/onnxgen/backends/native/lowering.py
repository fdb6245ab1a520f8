"""Lower an ONNX decoder graph once into a `Program`: a flat list of torch closures over value slots.

Passes, in order:
1. read the graph (no weights) and its initializers as zero-copy views of the memory-mapped data;
2. check every op is supported (else `UnsupportedOp` at load, naming op, domain, node, supported ops);
3. bind KV: the attention op (GroupQueryAttention / ai.onnx Attention) or the `Concat(past, new)` that
   consumes `past_key_values.L.*` and produces `present.L.*` is bound to the runtime's KV layer L;
   its past/present edges and the seqlens/total-length inputs disappear from the graph;
4. slice before the lm_head: the MatMul that produces the logits (through per-position ops) gets only
   the last position, so prefill never builds a `[seq, vocab]` tensor;
5. peephole fusions (`x * sigmoid(x)` -> Silu, `silu(g) * u` -> SiluMul; constant-weight MatMul /
   MatMulNBits (int4 dequantized at load) -> Linear; SiluMul of a gate and an up Linear of the same
   input -> LinearSiluMul over their weights concatenated, one product instead of two (two packed int4
   products -> Int4LinearSiluMul, their packed tensors side by side, SiLU in the GEMV); an RMSNorm read
   only by a Linear / LinearSiluMul -> RmsLinear, normalised inside one-row products (packed int4: the
   skip-norm's residual sum formed by the packed product that feeds it, and RmsInt4Linear, normalised
   inside the packed GEMV), the final norm too once the cut before the lm_head is moved before it; the
   lm_head writes float32 logits itself instead of a Cast after it); MoE / QMoE with constant experts ->
   the lowering's MoE over dense weights prepared once (`ops.moe.prepare_moe`: QMoE dequantized);
6. constant folding, dead-code elimination, placement (weights on the device; small integer tensors
   stay on the host, so shape arithmetic runs as host ints), slots and last-use frees.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import onnxgen.envs as envs
from onnxgen.backends.native import ops as O
from onnxgen.backends.native.kernels import cpu_gemm
from onnxgen.backends.native.kernels.cpu import ops as cpu_kernels
from onnxgen.backends.native.weights import ExternalData, tensor_from_proto
from onnxgen.errors import NotCapturable, UnsupportedModel, UnsupportedOp

log = logging.getLogger(__name__)

_NOT_FOLDABLE = {"GroupQueryAttention", "Attention", "KVConcat", "SliceLast"}
_PER_POSITION = {"Cast", "Identity", "Tanh", "Mul", "Div", "Add", "Sub", "Softcap"}


@dataclass
class Step:
    fn: Callable[..., tuple[Any, ...]]
    ins: tuple[int, ...]  # -1 = absent optional input
    outs: tuple[int, ...]  # -1 = output not used
    frees: tuple[int, ...]  # slots dead after this step
    node: O.Node


@dataclass
class Program:
    steps: list[Step]
    nslots: int
    consts: dict[int, torch.Tensor]
    input_slots: dict[str, int]
    logits_slot: int
    kv_layers: int
    uses_attention_mask: bool
    static_ok: bool  # every KV binding is a fused attention op (decode can be captured)
    weight_bytes: int
    # LongRoPE: the graph reads its long rotary tables when a sequence is longer than this (None: no switch;
    # `_rope_switch`)
    rope_switch: int | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def new_env(self) -> list[Any]:
        """A fresh slot list holding the constants (weights); inputs are set by the caller."""
        env: list[Any] = [None] * self.nslots
        for s, t in self.consts.items():
            env[s] = t
        return env

    def execute(self, env: list[Any], ctx: O.RunCtx) -> torch.Tensor:
        """Run every step over `env` (consumed: dead slots are cleared) and return the logits output. An
        op's error gets a note naming its node; `NotCapturable` passes through as it is."""
        for st in self.steps:
            args = [env[i] if i >= 0 else None for i in st.ins]
            try:
                res = st.fn(ctx, *args)
            except NotCapturable:
                raise
            except Exception as exc:
                exc.add_note(f"in node {st.node.name!r} ({st.node.domain or 'ai.onnx'}::{st.node.op})")
                raise
            for o, v in zip(st.outs, res, strict=False):
                if o >= 0:
                    env[o] = v
            for f in st.frees:
                env[f] = None
        return env[self.logits_slot]


def _attr_value(a: Any, ext: ExternalData) -> Any:
    from onnx import AttributeProto, helper

    if a.type == AttributeProto.TENSOR:
        return tensor_from_proto(a.t, ext)
    v = helper.get_attribute_value(a)
    if isinstance(v, bytes):
        return v.decode()
    return v


def _norm_domain(d: str) -> str:
    return "" if d in ("", "ai.onnx") else d


@dataclass(frozen=True)
class GraphOnly:
    """What `lower` needs to know of a graph that is not a decoder (a vision encoder, an embedding graph):
    its one output (read as the Program's `logits_slot`). No KV, no mask, no lm_head."""

    logits_name: str
    attention_mask_name: str | None = None
    num_layers: int = 0
    decoder: bool = False


def lower_graph(path: Path, output: str, device: torch.device) -> Program:
    """A graph that is not a decoder (no KV binding, no lm_head cut, no LongRoPE switch) as a Program whose
    `execute` returns `output`; its ops need no `RunCtx` state (pass `plain_ctx()`)."""
    return lower(path, GraphOnly(output), device)


def plain_ctx() -> O.RunCtx:
    """The `RunCtx` of a graph lowered by `lower_graph` (it reads no KV and no positions)."""
    return O.RunCtx(None, 0, 0, None, static=False)


def lower(
    path: Path,
    spec: Any,
    device: torch.device,
    int4: str = "dense",
    fuse: bool = True,
    shard: Callable[[list[O.Node], dict[str, torch.Tensor], Any], list[O.Node]] | None = None,
) -> Program:
    """Read `path` (the package's decoder graph) and build its Program for `device`. `int4`: "dense"
    dequantizes MatMulNBits weights at load; "packed" keeps them packed on the device and runs them as
    `Int4Linear` (ops.quant: a Triton GEMV on the packed bytes for decode rows). `fuse=False` leaves out the
    fusions across ops that compute the same values (LinearSiluMul, RmsLinear): one op per ONNX node, as
    the per-op error diagnostics (`numerics`) need. `spec` a `GraphOnly`: a graph without KV (`lower_graph`):
    the decoder's passes (KV binding, the cut before the lm_head and its moves, LongRoPE) are left out.
    `shard`: tensor parallelism's pass (`tp.shard.Sharder`), run on a decoder's nodes before the products are
    prepared and fused, so that this process reads, fuses and places its part of the weights only."""
    decoder = getattr(spec, "decoder", True)
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    if model.graph.node and any(n.op_type in ("Loop", "Scan") for n in model.graph.node):
        bad = next(n for n in model.graph.node if n.op_type in ("Loop", "Scan"))
        raise UnsupportedOp(bad.op_type, bad.domain, bad.name, O.supported_ops())
    ext = ExternalData(path.parent)
    consts: dict[str, torch.Tensor] = {}
    int4_meta: dict[str, tuple[tuple[int, ...], bool]] = {}
    for init in model.graph.initializer:
        consts[init.name] = tensor_from_proto(init, ext)
        if init.data_type in (21, 22):  # UINT4 / INT4: packed bytes; keep the logical shape
            int4_meta[init.name] = (tuple(int(d) for d in init.dims), init.data_type == 22)
    nodes = _read_nodes(model.graph.node, ext, consts)  # Constant nodes -> constants
    nodes = _lower_if(nodes, consts, ext)

    for n in nodes:
        O.builder(n)  # raises UnsupportedOp for an op the backend lacks, before any rewrite

    graph_inputs = [i.name for i in model.graph.input if i.name not in consts]
    rope_switch, static_ok = None, False
    if decoder:
        nodes, rope_switch = _rope_switch(nodes, consts, spec.attention_mask_name)
        nodes, static_ok = _bind_kv(nodes, spec)
        nodes = _slice_before_lm_head(nodes, spec.logits_name, consts)
    nodes = _fuse_silu(nodes, spec.logits_name)
    nodes = _dce(nodes, [spec.logits_name])
    nodes = _fold_constants(nodes, consts)
    if shard is not None and decoder:
        nodes = shard(nodes, consts, spec)
    on_device: set[str] = set()  # packed int4 weights, scales and zero points: never host tensors
    nodes = _prepare_linear(nodes, consts, device, int4_meta, packed=int4 == "packed", on_device=on_device)
    # MoE / QMoE experts prepared once (`ops.moe`): dense, or QMoE's 4-bit experts kept packed
    nodes = O.prepare_moe(nodes, consts, device, spec, packed=int4 == "packed", on_device=on_device)
    if fuse and decoder:
        nodes = _split_into_gqa(nodes, consts)
        nodes = _cast_into_norm(nodes)
        nodes = _fuse_gelu_mul(nodes)
        nodes = _merge_gate_up(nodes, consts, device, on_device)
        nodes = _mrope_into_gqa(nodes, consts, device)
        if envs.read("RESIDUAL_INTO_PRODUCT"):
            _residual_into_product(nodes, spec.logits_name)
        nodes = _cut_before_final_norm(nodes)
        nodes = _fuse_norm_linear(nodes, consts)
        _rope_into_qkv(nodes, consts, device)
        nodes = _cast_into_product(nodes)
    nodes = _dce(nodes, [spec.logits_name])
    if device.type == "cpu":
        _prepack_cpu(nodes, consts)
        if fuse and decoder and cpu_kernels.library() is not None:
            nodes = _fuse_cpu_layers(nodes, consts)

    # Placement: every constant a step reads.
    used: set[str] = {x for n in nodes for x in n.inputs if x}
    placed: dict[str, torch.Tensor] = {}
    memo: dict[tuple[Any, ...], torch.Tensor] = {}
    weight_bytes = 0
    for name in used:
        if name not in consts:
            continue
        t = consts[name]
        if (name in on_device or not _is_host(t)) and device.type != "cpu":
            key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
            dt = memo.get(key)
            if dt is None:
                dt = t.to(device)
                if not dt.is_contiguous():
                    dt = dt.contiguous()
                memo[key] = dt
            t = dt
        placed[name] = t
        if t.numel() > 1024:
            weight_bytes += t.numel() * t.element_size()
    del consts, memo

    # Slots.
    slot: dict[str, int] = {}

    def sid(name: str) -> int:
        if not name:
            return -1
        if name not in slot:
            slot[name] = len(slot)
        return slot[name]

    input_slots = {name: sid(name) for name in graph_inputs}
    const_slots = {sid(name): t for name, t in placed.items()}
    last_use: dict[int, int] = {}
    for i, n in enumerate(nodes):
        for x in n.inputs:
            if x:
                last_use[sid(x)] = i
    logits_slot = sid(spec.logits_name)
    consumed = {x for n in nodes for x in n.inputs if x}
    steps: list[Step] = []
    for i, n in enumerate(nodes):
        ins = tuple(sid(x) for x in n.inputs)
        # trim trailing absent inputs so builders' optional defaults apply
        while ins and ins[-1] == -1:
            ins = ins[:-1]
        outs = tuple(sid(o) if (o and (o in consumed or o == spec.logits_name)) else -1 for o in n.outputs)
        frees = tuple(
            s
            for s in set(ins)
            if s >= 0 and s not in const_slots and last_use.get(s) == i and s != logits_slot
        )
        steps.append(Step(O.builder(n)(n), ins, outs, frees, n))
    mask_name = spec.attention_mask_name
    uses_mask = bool(mask_name) and mask_name in consumed
    return Program(
        steps=steps,
        nslots=len(slot),
        consts=const_slots,
        input_slots=input_slots,
        logits_slot=logits_slot,
        kv_layers=spec.num_layers,
        uses_attention_mask=uses_mask,
        static_ok=static_ok and not uses_mask,
        weight_bytes=weight_bytes,
        rope_switch=rope_switch,
        info={
            "ops": sorted({f"{n.domain + '::' if n.domain else ''}{n.op}" for n in nodes}),
            "steps": len(steps),
        },
    )


def _is_host(t: torch.Tensor) -> bool:
    """Small integer tensors stay on the host: they are shapes, axes and indices."""
    return (not t.dtype.is_floating_point) and t.numel() <= 1024


def _read_nodes(protos: Any, ext: ExternalData, consts: dict[str, torch.Tensor]) -> list[O.Node]:
    """A graph's nodes as `Node`s (attribute tensors read, memory-mapped); Constant nodes go into `consts`."""
    nodes: list[O.Node] = []
    for i, n in enumerate(protos):
        attrs = {a.name: _attr_value(a, ext) for a in n.attribute}
        node = O.Node(
            n.op_type,
            _norm_domain(n.domain),
            n.name or f"{n.op_type}_{i}",
            list(n.input),
            list(n.output),
            attrs,
        )
        if node.op == "Constant" and node.domain == "":
            consts[node.outputs[0]] = _constant_value(node)
        else:
            nodes.append(node)
    return nodes


def _constant_value(n: O.Node) -> torch.Tensor:
    a = n.attrs
    if "value" in a:
        return a["value"]
    if "value_float" in a:
        return torch.tensor(float(a["value_float"]), dtype=torch.float32)
    if "value_floats" in a:
        return torch.tensor(list(a["value_floats"]), dtype=torch.float32)
    if "value_int" in a:
        return torch.tensor(int(a["value_int"]), dtype=torch.int64)
    if "value_ints" in a:
        return torch.tensor(list(a["value_ints"]), dtype=torch.int64)
    raise UnsupportedOp("Constant", "", n.name, O.supported_ops())


# --- If ------------------------------------------------------------------------------------------------


def _lower_if(nodes: list[O.Node], consts: dict[str, torch.Tensor], ext: ExternalData) -> list[O.Node]:
    """Each ai.onnx `If` -> `IfConst(cond, then..., else...)` (`ops.control`) over its branches' outputs,
    evaluated here once (new constants named `<node>::then::<i>` / `<node>::else::<i>`). A branch must compute
    from constants only (its Constant nodes and initializers, the outer graph's constants); otherwise
    `UnsupportedOp` names the branch, the node and the run-time value it reads."""
    out = []
    for n in nodes:
        if not (n.op == "If" and n.domain == ""):
            out.append(n)
            continue
        values = {}
        for which in ("then", "else"):
            values[which] = _fold_branch(n, which, consts, ext)
            for i, v in enumerate(values[which]):
                consts[f"{n.name}::{which}::{i}"] = v
        k = len(n.outputs)
        names = [f"{n.name}::{which}::{i}" for which in ("then", "else") for i in range(k)]
        out.append(O.Node("IfConst", O.INTERNAL, n.name, [n.inputs[0], *names], list(n.outputs)))
    return out


def _fold_branch(
    n: O.Node, which: str, consts: dict[str, torch.Tensor], ext: ExternalData
) -> list[torch.Tensor]:
    """The output values of `If` node `n`'s branch `which` ("then" / "else"), computed from constants."""

    def bad(why: str) -> UnsupportedOp:
        return UnsupportedOp(f"If({which}_branch {why})", "", n.name, O.supported_ops())

    g = n.attr(f"{which}_branch")
    if g is None:
        raise bad("missing")
    if len(g.input):
        raise bad("with inputs")
    local = dict(consts)
    for init in g.initializer:
        local[init.name] = tensor_from_proto(init, ext)
    try:
        body = _lower_if(_read_nodes(g.node, ext, local), local, ext)
    except UnsupportedOp as exc:
        raise bad(f"holds a node the native backend cannot lower: {exc.op}") from exc
    for m in body:
        missing = [x for x in m.inputs if x and x not in local]
        if missing:
            raise bad(f"is not constant: node {m.name!r} ({m.op}) reads {missing[0]!r}")
        if m.op in _NOT_FOLDABLE or (m.domain == "onnxgen" and m.op != "IfConst"):
            raise bad(f"is not constant: node {m.name!r} ({m.op}) cannot run at load")
        O.builder(m)
        _fold_constants([m], local)
        if any(o and o not in local for o in m.outputs):
            raise bad(f"is not constant: node {m.name!r} ({m.op}) was not computed at load")
    outs = [o.name for o in g.output]
    if len(outs) != len(n.outputs) or any(o not in local for o in outs):
        raise bad("does not produce the If's outputs from constants")
    return [local[o] for o in outs]


def _rope_switch(
    nodes: list[O.Node], consts: dict[str, torch.Tensor], mask: str | None
) -> tuple[list[O.Node], int | None]:
    """LongRoPE, as the model builder writes it: `IfConst(Greater(attention_mask.shape[1], C))` choosing between
    long (then) and short (else) rotary tables `[rows, rotary_dim / 2]` that only rotary lookups read
    (GroupQueryAttention's cos/sin caches, RotaryEmbedding's with position ids). Rewritten so that nothing reads
    the mask: each output becomes one constant table, the short rows followed by the long ones, and each reader
    gets `_rope_switch = (C, short rows)`: a token reads row position + short rows when its sequence is longer
    than C (`ops.rotary.rope_rows`, on the device: static and batched steps keep working). Returns the nodes
    and C (None: no such switch; other `IfConst`s stay as they are)."""
    producer = {o: n for n in nodes for o in n.outputs if o}
    readers = _readers(nodes)

    def scalar(name: str) -> int | None:
        t = consts.get(name)
        return (
            int(t.reshape(-1)[0]) if t is not None and t.numel() == 1 and not t.is_floating_point() else None
        )

    def mask_length(name: str) -> bool:
        p = producer.get(name)
        while p is not None and p.op in ("Cast", "Squeeze", "Reshape", "Identity") and p.domain == "":
            p = producer.get(p.inputs[0])
        if p is None or p.op != "Gather" or p.domain != "" or scalar(p.inputs[1]) != 1:
            return False
        shape = producer.get(p.inputs[0])
        return (
            shape is not None
            and shape.op == "Shape"
            and shape.inputs[0] == mask
            and not shape.attr("start", 0)
            and int(p.attr("axis", 0)) == 0
        )

    def tables(r: O.Node) -> list[str] | None:
        """The rotary tables `r` looks up by position (None: `r` is no such lookup)."""
        ins = r.inputs + [""] * 9
        if r.op == "GroupQueryAttention" and r.domain == "com.microsoft" and int(r.attr("do_rotary", 0)):
            return ins[7:9]
        if r.op == "RotaryEmbedding" and r.domain == "com.microsoft":
            return ins[2:4]
        if r.op == "RotaryEmbedding" and r.domain == "" and ins[3]:
            return ins[1:3]
        return None

    def switched(r: O.Node, outs: list[str], key: tuple[int, int]) -> bool:
        """`r` reads `outs` (one If's tables) as its rotary tables only, both of them from that If."""
        t = tables(r)
        others = [x for i, x in enumerate(r.inputs) if x in outs and (t is None or x not in t)]
        return (
            t is not None and set(t) <= set(outs) and not others and r.attrs.get("_rope_switch", key) == key
        )

    found: int | None = None
    drop: set[int] = set()
    for n in nodes:
        if n.op != "IfConst" or n.domain != "onnxgen" or not mask:
            continue
        cond = producer.get(n.inputs[0])
        if cond is None or cond.op != "Greater" or cond.domain != "" or not mask_length(cond.inputs[0]):
            continue
        limit = scalar(cond.inputs[1])
        k = len(n.outputs)
        then = [consts[x] for x in n.inputs[1 : 1 + k]]
        other = [consts[x] for x in n.inputs[1 + k :]]
        if (
            limit is None
            or (found is not None and limit != found)
            or any(
                a.dim() != 2
                or b.dim() != 2
                or a.shape[1] != b.shape[1]
                or a.dtype != b.dtype
                or not a.is_floating_point()
                for a, b in zip(then, other, strict=True)
            )
            or len({b.shape[0] for b in other}) != 1
            or other[0].shape[0] < limit  # the short tables cover every position below the switch
            or not all(
                readers.get(o)
                and all(switched(r, n.outputs, (limit, int(other[0].shape[0]))) for r in readers[o])
                for o in n.outputs
            )
        ):
            continue
        rows = int(other[0].shape[0])
        for o, a, b in zip(n.outputs, then, other, strict=True):
            consts[o] = torch.cat([b, a])
            for r in readers[o]:
                r.attrs["_rope_switch"] = (limit, rows)
        found = limit
        drop.add(id(n))
    return [n for n in nodes if id(n) not in drop], found


# --- KV binding --------------------------------------------------------------------------------------


def _bind_kv(nodes: list[O.Node], spec: Any) -> tuple[list[O.Node], bool]:
    past = {}
    for layer, (k, v) in enumerate(zip(spec.past_key_names, spec.past_value_names, strict=True)):
        past[k] = (layer, "key")
        past[v] = (layer, "value")
    present = set(spec.present_key_names) | set(spec.present_value_names)
    bound: dict[int, list[str]] = {}
    static_ok = True
    out = []
    for n in nodes:
        hits = [(i, x) for i, x in enumerate(n.inputs) if x in past]
        if not hits:
            out.append(n)
            continue
        layers = {past[x][0] for _, x in hits}
        if len(layers) != 1:
            raise UnsupportedModel(
                f"node {n.name!r} reads the past KV of several layers; cannot bind the KV cache"
            )
        layer = layers.pop()
        if n.domain == "com.microsoft" and n.op == "GroupQueryAttention":
            if {i for i, _ in hits} != {3, 4}:
                raise UnsupportedModel(f"{n.name}: past KV in unexpected GroupQueryAttention inputs")
            _check_gqa(n)
            n.inputs = [x if i not in (3, 4, 5, 6, 9) else "" for i, x in enumerate(n.inputs)]
            n.outputs = [n.outputs[0], "", "", *n.outputs[3:]]
            n.layer = layer
            if len(n.inputs) > 10 and n.inputs[10]:
                static_ok = False
        elif n.domain == "" and n.op == "Attention":
            if {i for i, _ in hits} != {4, 5}:
                raise UnsupportedModel(f"{n.name}: past KV in unexpected Attention inputs")
            if int(n.attr("qk_matmul_output_mode", 0)) or (len(n.outputs) > 3 and n.outputs[3]):
                raise UnsupportedOp("Attention(qk_matmul_output)", "", n.name, O.supported_ops())
            if len(n.inputs) > 6 and n.inputs[6]:
                raise UnsupportedOp("Attention(nonpad_kv_seqlen)", "", n.name, O.supported_ops())
            n.inputs = [x if i not in (4, 5) else "" for i, x in enumerate(n.inputs)]
            n.outputs = [n.outputs[0], "", ""] + [""] * (len(n.outputs) - 3)
            n.layer = layer
            if len(n.inputs) > 3 and n.inputs[3]:
                static_ok = False
        elif (
            n.domain == "" and n.op == "Concat" and len(n.inputs) == 2 and hits[0][0] == 0 and len(hits) == 1
        ):
            ax = int(n.attr("axis"))
            if ax not in (2, -2) or n.outputs[0] not in present:
                raise UnsupportedModel(
                    f"{n.name}: Concat over the past KV must be on axis 2 and produce a present output"
                )
            n.op, n.domain = "KVConcat", "onnxgen"
            n.layer, n.kv_role = layer, past[hits[0][1]][1]
            static_ok = False
        else:
            raise UnsupportedModel(
                f"node {n.name!r} ({n.op}) consumes the past KV {hits[0][1]!r}; the native backend binds KV only "
                "through GroupQueryAttention, ai.onnx Attention or Concat(past, new) -> present"
            )
        bound.setdefault(layer, []).append(n.name)
        out.append(n)
    missing = [i for i in range(spec.num_layers) if i not in bound]
    if missing:
        raise UnsupportedModel(
            f"no attention consumes the past KV of layer(s) {missing}; cannot bind the KV cache"
        )
    return out, static_ok


def _check_gqa(n: O.Node) -> None:
    def bad(feature: str) -> None:
        raise UnsupportedOp(f"GroupQueryAttention({feature})", "com.microsoft", n.name, O.supported_ops())

    ins = n.inputs + [""] * 17
    if ins[12] or ins[13] or n.attr("kv_cache_bit_width"):
        bad("quantized KV")
    if ins[16]:
        bad("query_seqlens")
    if int(n.attr("smooth_softmax", 0)):
        bad("smooth_softmax")
    if int(n.attr("causal", 1)) != 1:
        bad("causal=0")
    # `sliding_window_cache` (the builder's windowed layers) only tells onnxruntime that the past/present
    # buffers are window-sized rings; the runtime owns the KV here and attends over the last
    # `local_window_size` positions of its own buffers (`ops.attention.attend`), so it needs nothing more.
    if int(n.attr("qk_output", 0)):
        bad("qk_output")
    if int(n.attr("do_rotary", 0)) and not (ins[7] and ins[8]):
        bad("do_rotary without cos/sin caches")


# --- logits: last position only ----------------------------------------------------------------------


def _slice_before_lm_head(nodes: list[O.Node], logits: str, consts: dict[str, torch.Tensor]) -> list[O.Node]:
    producer = {o: n for n in nodes for o in n.outputs if o}
    cur = producer.get(logits)
    while cur is not None and cur.op in _PER_POSITION and cur.domain == "":
        dyn = [x for x in cur.inputs if x and x not in consts]
        if len(dyn) != 1:
            cur = None
            break
        cur = producer.get(dyn[0])
    if cur is None or not (
        (cur.op in ("MatMul", "Gemm") and cur.domain == "")
        or (cur.op == "MatMulNBits" and cur.domain == "com.microsoft")
    ):
        log.warning("could not find the lm_head MatMul; logits of every position are computed")
        tail = O.Node("SliceLast", "onnxgen", "onnxgen/slice_logits", [logits + "::all"], [logits])
        for n in nodes:
            n.outputs = [logits + "::all" if o == logits else o for o in n.outputs]
        return [*nodes, tail]
    src = cur.inputs[0]
    sliced = src + "::last"
    cut = O.Node("SliceLast", "onnxgen", "onnxgen/slice_last", [src], [sliced])
    out = []
    for n in nodes:
        if n is cur:
            out.append(cut)
            n.inputs = [sliced, *n.inputs[1:]]
        out.append(n)
    return out


# --- fusions ------------------------------------------------------------------------------------------


def _readers(nodes: list[O.Node]) -> dict[str, list[O.Node]]:
    """Each value's reading nodes, once per input slot that reads it (a node reading it twice is listed twice)."""
    readers: dict[str, list[O.Node]] = {}
    for n in nodes:
        for x in n.inputs:
            if x:
                readers.setdefault(x, []).append(n)
    return readers


def _fuse_gelu_mul(nodes: list[O.Node]) -> list[O.Node]:
    """`Mul(Gelu(g, approximate="tanh"), u)` (or com.microsoft `FastGelu` without bias) whose gelu only the
    Mul reads -> `GeluMul(g, u)` (Gemma's gated MLP): one launch, float32 inside, rounded once."""
    readers = _readers(nodes)
    drop: set[int] = set()
    for n in nodes:
        approx = n.attr("approximate", "none")
        approx = approx.decode() if isinstance(approx, bytes) else approx
        tanh = (n.op == "Gelu" and n.domain in ("", "com.microsoft") and approx == "tanh") or (
            n.op == "FastGelu" and n.domain == "com.microsoft" and not any(n.inputs[1:])
        )
        users = readers.get(n.outputs[0], [])
        if not tanh or len(users) != 1 or users[0].op != "Mul" or users[0].domain != "":
            continue
        mul = users[0]
        other = [v for v in mul.inputs if v != n.outputs[0]]
        if len(mul.inputs) != 2 or len(other) != 1:
            continue
        mul.op, mul.domain, mul.inputs = "GeluMul", "onnxgen", [n.inputs[0], other[0]]
        drop.add(id(n))
    return [n for n in nodes if id(n) not in drop]


def _fuse_silu(nodes: list[O.Node], logits: str) -> list[O.Node]:
    consumers = _readers(nodes)
    drop: set[int] = set()
    produced = {o for n in nodes for o in n.outputs}
    for n in nodes:
        if n.op != "Sigmoid" or n.domain != "":
            continue
        x, sig = n.inputs[0], n.outputs[0]
        users = consumers.get(sig, [])
        if len(users) != 1 or users[0].op != "Mul" or set(users[0].inputs) != {x, sig}:
            continue
        mul = users[0]
        drop.add(id(n))
        mul.op, mul.domain, mul.inputs = "Silu", "onnxgen", [x]
        # silu(g) * u -> SiluMul(g, u)
        s_users = consumers.get(mul.outputs[0], [])
        if (
            len(s_users) == 1
            and s_users[0].op == "Mul"
            and s_users[0].domain == ""
            and mul.outputs[0] != logits
        ):
            m2 = s_users[0]
            other = [v for v in m2.inputs if v != mul.outputs[0]]
            if len(other) == 1:
                drop.add(id(mul))
                m2.op, m2.domain, m2.inputs = "SiluMul", "onnxgen", [x, other[0]]
                # NOTE: when the gate is a node's output used only by this silu, SiluMul may overwrite
                # it in place: the prefill activation peak then holds two [seq, inter] tensors, not three.
                if x in produced and len(consumers.get(x, [])) == 2 and x not in (logits, other[0]):
                    m2.attrs["gate_dead"] = 1
    return [n for n in nodes if id(n) not in drop]


def _nk_layout(cuda: bool, dtype: torch.dtype) -> bool:
    """Whether a constant weight is kept `[N, K]` (contiguous, for `F.linear`) rather than `[K, N]`.

    CUDA: always (cuBLAS' preferred layout). CPU: for every dtype but float32 -- without native bf16/fp16
    instructions torch's CPU `x @ w` over a `[K, N]` bf16 weight takes a reference path ~70x slower than
    `F.linear` over `[N, K]` (7 s vs 0.1 s for 64 x 2048 x 8192 on an AVX2 core pair)."""
    return cuda or dtype != torch.float32


# the weight's input of each product op that runs over a constant `[K, N]` weight on the CPU
_WEIGHT_INPUT = {"Linear": 1, "LinearSiluMul": 1, "LinearGeluMul": 1, "RmsLinear": 3}


def _prepack_cpu(nodes: list[O.Node], consts: dict[str, torch.Tensor]) -> None:
    """CPU float32 products over a `[K, N]` weight (`kernels.cpu_gemm`): the weight's oneDNN copy for their
    several-row products, made once per weight and held by the node (`_packed`); then the weight itself
    replaced by its split layout (a block of columns per torch thread) where products are its only readers."""
    packed: dict[str, torch.Tensor | None] = {}
    readers: dict[str, int] = {}  # weight name -> how many inputs of any node read it
    for n in nodes:
        for x in n.inputs:
            if x:
                readers[x] = readers.get(x, 0) + 1
    as_weight: dict[str, int] = {}  # weight name -> how many products read it as their weight
    for n in nodes:
        i = _WEIGHT_INPUT.get(n.op) if n.domain == "onnxgen" else None
        if i is None or n.attrs.get("_transposed") or len(n.inputs) <= i or n.inputs[i] not in consts:
            continue
        name = n.inputs[i]
        as_weight[name] = as_weight.get(name, 0) + 1
        if name not in packed:
            packed[name] = cpu_gemm.prepack(consts[name])
        if packed[name] is not None:
            n.attrs["_packed"] = packed[name]
    parts = cpu_gemm.split_parts()
    for name, count in as_weight.items():
        if count == readers[name]:
            blocks = cpu_gemm.split(consts[name], parts)
            if blocks is not None:
                consts[name] = blocks


def _fuse_cpu_layers(nodes: list[O.Node], consts: dict[str, torch.Tensor]) -> list[O.Node]:
    """Each run of five consecutive nodes forming a pre-norm decoder layer the CPU's C kernels run whole
    (`ops.cpu_layer`) replaced by one CpuLayer node: RmsLinear (no skip, QKV with `_rope`) -> packed
    GroupQueryAttention (fused rotary, no bias or q/k norms, MRoPE's tables not) -> Linear (output product,
    the layer input as its residual) -> RmsLinear (no skip, gate/up + SiLU) -> Linear (down product, the
    attention block's sum as its residual), weights and norms constant, every value between them read only
    inside the layer. Others stay as they are."""
    readers: dict[str, int] = {}
    for n in nodes:
        for x in n.inputs:
            if x:
                readers[x] = readers.get(x, 0) + 1
    out: list[O.Node] = []
    i = 0
    while i < len(nodes):
        run = nodes[i : i + 5]
        if len(run) == 5 and _is_cpu_layer(run, consts, readers):
            a, b, c, d, e = run
            inside = {a.outputs[0], b.outputs[0], c.outputs[0], d.outputs[0]}
            ins = list(dict.fromkeys(x for p in run for x in p.inputs if x and x not in inside))
            out.append(
                O.Node(
                    "CpuLayer",
                    "onnxgen",
                    f"{a.name}..{e.name}",
                    ins,
                    [e.outputs[0]],
                    {"_parts": run},
                    layer=b.layer,
                )
            )
            i += 5
            continue
        out.append(nodes[i])
        i += 1
    return out


def _is_cpu_layer(run: list[O.Node], consts: dict[str, torch.Tensor], readers: dict[str, int]) -> bool:
    a, b, c, d, e = run

    def inp(n: O.Node, k: int) -> str:
        return n.inputs[k] if len(n.inputs) > k else ""

    def used(n: O.Node, k: int) -> bool:
        return len(n.outputs) > k and bool(n.outputs[k]) and readers.get(n.outputs[k], 0) > 0

    ops = [(n.domain, n.op) for n in run]
    if ops != [
        ("onnxgen", "RmsLinear"),
        ("com.microsoft", "GroupQueryAttention"),
        ("onnxgen", "Linear"),
        ("onnxgen", "RmsLinear"),
        ("onnxgen", "Linear"),
    ]:
        return False
    if any(n.attrs.get("_transposed") or n.attrs.get("_out_float") for n in run):
        return False
    rope = a.attr("_rope")
    if rope is None or a.attr("silu", 0) or inp(a, 1) or not d.attr("silu", 0) or inp(d, 1):
        return False
    if (
        a.attr("_rope_switch") != b.attr("_rope_switch")
        or b.attr("_step_tables")
        or not b.attr("do_rotary", 0)
    ):
        return False
    if inp(b, 1) or inp(b, 2) or inp(b, 10) or inp(b, 14) or inp(b, 15) or b.layer != rope[0]:
        return False
    if inp(b, 0) != a.outputs[0] or inp(c, 0) != b.outputs[0] or inp(d, 0) != c.outputs[0]:
        return False
    if inp(e, 0) != d.outputs[0] or inp(c, 5) != inp(a, 0) or inp(e, 5) != c.outputs[0]:
        return False
    if (
        any(inp(n, k) for n in (c, e) for k in (2, 3, 4))
        or used(a, 1)
        or used(b, 1)
        or used(b, 2)
        or used(d, 1)
    ):
        return False
    if (inp(a, 4), inp(a, 5)) != (inp(b, 7), inp(b, 8)):
        return False
    constant = [inp(a, 2), inp(a, 3), inp(b, 7), inp(b, 8), inp(c, 1), inp(d, 2), inp(d, 3), inp(e, 1)]
    if inp(b, 11):
        constant.append(inp(b, 11))
    if not all(x and x in consts for x in constant):
        return False
    # each value between the five read only by the next of them (the attention block's sum: by both MLP ops)
    return (
        readers.get(a.outputs[0]) == 1
        and readers.get(b.outputs[0]) == 1
        and readers.get(c.outputs[0]) == 2
        and readers.get(d.outputs[0]) == 1
    )


def _prepare_linear(
    nodes: list[O.Node],
    consts: dict[str, torch.Tensor],
    device: torch.device,
    int4_meta: dict[str, tuple[tuple[int, ...], bool]],
    packed: bool = False,
    on_device: set[str] | None = None,
) -> list[O.Node]:
    """Constant-weight MatMul / MatMulNBits -> Linear (`packed`: MatMulNBits -> Int4Linear on its packed
    inputs, named in `on_device`); GatherBlockQuantized -> Gather over a dequantized table."""
    cuda = device.type == "cuda"
    for n in nodes:
        if n.domain == "" and n.op == "MatMul" and n.inputs[1] in consts and consts[n.inputs[1]].dim() == 2:
            w = consts[n.inputs[1]]
            if _nk_layout(cuda, w.dtype):
                name = n.inputs[1] + "::T"
                if name not in consts:
                    # made contiguous on the device at placement; on the CPU here (a copy of the mapped data)
                    consts[name] = w.t() if cuda else w.t().contiguous()
                n.inputs = [n.inputs[0], name]
                n.attrs["_transposed"] = 1
            n.op, n.domain = "Linear", "onnxgen"
        elif n.domain == "com.microsoft" and n.op == "MatMulNBits":
            if not all(x in consts for x in n.inputs[1:4] if x):
                raise UnsupportedOp("MatMulNBits(non-constant weights)", n.domain, n.name, O.supported_ops())
            k, nn = int(n.attr("K")), int(n.attr("N"))
            bits, block = int(n.attr("bits", 4)), int(n.attr("block_size"))
            if len(n.inputs) > 4 and n.inputs[4]:
                g = consts.get(n.inputs[4])
                if g is None or not O.trivial_g_idx(g, k, block):  # a trivial one says nothing
                    raise UnsupportedOp("MatMulNBits(g_idx)", n.domain, n.name, O.supported_ops())
            zp = consts[n.inputs[3]] if len(n.inputs) > 3 and n.inputs[3] else None
            scales = consts[n.inputs[2]]
            if packed:
                if bits != 4 or block % 8:
                    raise UnsupportedOp(
                        f"MatMulNBits(bits={bits}, block_size={block})", n.domain, n.name, O.supported_ops()
                    )
                # the packed bytes K-major (the GEMV's layout, `ops.quant.kmajor`), built on the device, once per
                # initializer: the originals are not placed (no node reads them any more)
                names = [
                    n.inputs[1] + "::kmajor",
                    n.inputs[2] + "::kmajor",
                    n.inputs[3] + "::kmajor" if zp is not None else "",
                ]
                if names[0] not in consts:
                    dev = device if cuda else torch.device("cpu")
                    zdev = None if zp is None else zp.to(dev)
                    kw = O.kmajor(consts[n.inputs[1]].to(dev), scales.to(dev), zdev, k, nn, block)
                    for name, t in zip(names, kw, strict=True):
                        if name:
                            consts[name] = t
                bias = n.inputs[5] if len(n.inputs) > 5 and n.inputs[5] else ""
                n.inputs = [n.inputs[0], *names, bias]
                if on_device is not None:
                    on_device.update(x for x in names if x)
                n.op, n.domain = "Int4Linear", "onnxgen"
                continue
            dev = device if cuda else torch.device("cpu")
            w = O.dequant_matmul_nbits(
                consts[n.inputs[1]].to(dev),
                scales.to(dev),
                None if zp is None else zp.to(dev),
                k,
                nn,
                bits,
                block,
                scales.dtype,
            )
            name = n.name + "::dequant"
            if _nk_layout(cuda, w.dtype):
                consts[name] = w  # [N, K]
                n.attrs["_transposed"] = 1
            else:
                consts[name] = w.t()  # [K, N] view for x @ w
            bias = n.inputs[5] if len(n.inputs) > 5 and n.inputs[5] else ""
            n.inputs = [n.inputs[0], name] + ([bias] if bias else [])
            n.op, n.domain = "Linear", "onnxgen"
        elif n.domain == "com.microsoft" and n.op == "GatherBlockQuantized":
            data, _idx, sc = n.inputs[0], n.inputs[1], n.inputs[2]
            zp = n.inputs[3] if len(n.inputs) > 3 else ""
            if data not in consts or sc not in consts or (zp and zp not in consts):
                raise UnsupportedOp(
                    "GatherBlockQuantized(non-constant table)", n.domain, n.name, O.supported_ops()
                )
            if int(n.attr("gather_axis", 0)) != 0:
                raise UnsupportedOp(
                    "GatherBlockQuantized(gather_axis!=0)", n.domain, n.name, O.supported_ops()
                )
            shape, signed = int4_meta.get(data, (None, False))
            raw = consts[data]
            scales = consts[sc]
            if shape is None:  # uint8 packed: last dim holds two values per byte
                shape = (*raw.shape[:-1], raw.shape[-1] * 2)
            table = O.dequant_gather_block(
                raw,
                scales,
                consts[zp] if zp else None,
                bits=int(n.attr("bits", 4)),
                block=int(n.attr("block_size", 128)),
                quant_axis=int(n.attr("quantize_axis", 1)),
                signed=signed,
                shape=tuple(shape),
            )
            name = n.name + "::dequant"
            consts[name] = table
            n.inputs = [name, n.inputs[1]]
            n.op, n.domain = "Gather", ""
            n.attrs = {"axis": 0}
    return nodes


def _merge_gate_up(
    nodes: list[O.Node],
    consts: dict[str, torch.Tensor],
    device: torch.device,
    on_device: set[str] | None = None,
) -> list[O.Node]:
    """`SiluMul(Linear(x, Wg), Linear(x, Wu))` -> `LinearSiluMul(x, [Wg | Wu])` (`GeluMul` -> `LinearGeluMul`,
    dense weights only) when both Linears have no
    bias, the same layout and dtype, and feed only the SiluMul. The merged weight is built on the device
    (CUDA: the halves are copied there first, so no host copy of the weights is made). Two packed
    `Int4Linear`s the same way -> `Int4LinearSiluMul` (their `kmajor` tensors side by side along N, on the
    device like the halves, named in `on_device`; the halves are dropped once merged)."""
    producer = {o: n for n in nodes for o in n.outputs if o}
    readers = _readers(nodes)
    drop: set[int] = set()
    for m in nodes:
        if m.op not in ("SiluMul", "GeluMul") or m.domain != "onnxgen":
            continue
        g, u = (producer.get(x) for x in m.inputs)
        if (
            g is None
            or u is None
            or g is u
            or g.inputs[0] != u.inputs[0]
            or any(len(readers.get(p.outputs[0], ())) != 1 for p in (g, u))
        ):
            continue
        if g.op == u.op == "Int4Linear" and g.domain == u.domain == "onnxgen" and m.op == "SiluMul":
            if _merge_int4_pair(m, g, u, consts, readers, on_device):
                drop.update((id(g), id(u)))
            continue
        if any(
            p.op != "Linear" or p.domain != "onnxgen" or len(p.inputs) != 2 or p.inputs[1] not in consts
            for p in (g, u)
        ):
            continue
        t = bool(g.attrs.get("_transposed", 0))
        wg, wu = consts[g.inputs[1]], consts[u.inputs[1]]
        if t != bool(u.attrs.get("_transposed", 0)) or wg.dtype != wu.dtype or wg.shape != wu.shape:
            continue
        name = _joined_weight(consts, [g.inputs[1], u.inputs[1]], t, device)
        m.op = "LinearSiluMul" if m.op == "SiluMul" else "LinearGeluMul"
        m.inputs, m.attrs = [g.inputs[0], name], {"_transposed": int(t)}
        drop.update((id(g), id(u)))
    return [n for n in nodes if id(n) not in drop]


def _joined_weight(
    consts: dict[str, torch.Tensor], names: list[str], transposed: bool, device: torch.device
) -> str:
    """The name of one product weight of the products of weights `names` side by side along their output
    features (rows of `[N, K]` when `transposed`, columns of `[K, N]` otherwise), made once (on CUDA on the
    device)."""
    name = "+".join(names)
    if name not in consts:
        ws = [consts[x].to(device) if device.type == "cuda" else consts[x] for x in names]
        consts[name] = torch.cat(ws, dim=0 if transposed else 1)
    return name


def _mrope_into_gqa(
    nodes: list[O.Node], consts: dict[str, torch.Tensor], device: torch.device
) -> list[O.Node]:
    """`GroupQueryAttention(MRotaryEmbedding(Linear(x, Wq)), MRotaryEmbedding(Linear(x, Wk)), Linear(x, Wv))`
    (Qwen-VL's decoder from the builder: MRoPE outside the attention, do_rotary 0) -> `GroupQueryAttention(
    Linear(x, [Wq | Wk | Wv]))` with do_rotary 1 over the step's own rotary tables: one `MRopeTables` node
    per graph (`ops.rotary.mrope_tables`, placed at the first MRoPE) gathers each token's cos / sin by its
    section's position row once per forward, and the attention (`_step_tables`) reads row i for token i. The
    same values (rotary in float32 over the same cos / sin, one rounding); the layer then takes the text
    decoders' fused paths (packed QKV: the norm into the product, `_rope_into_qkv`, `rope_qkv_write`).
    Only when the three Linears have no bias, constant weights of one layout and dtype, and feed nothing else,
    and both rotaries share positions, tables and the sectioned layout."""
    producer = {o: n for n in nodes for o in n.outputs if o}
    readers = _readers(nodes)
    drop: set[int] = set()
    tables: dict[tuple[str, str, str, tuple[int, ...]], tuple[str, str]] = {}
    before: dict[int, O.Node] = {}  # id(first MRoPE of a table set) -> its MRopeTables node
    for g in nodes:
        if not (g.op == "GroupQueryAttention" and g.domain == "com.microsoft" and g.layer is not None):
            continue
        ins = g.inputs + [""] * 12
        if int(g.attr("do_rotary", 0)) or not (ins[0] and ins[1] and ins[2]) or any(ins[7:10]):
            continue
        rq, rk = producer.get(ins[0]), producer.get(ins[1])
        if any(
            r is None
            or r.op != "MRotaryEmbedding"
            or r.domain != "com.microsoft"
            or len(readers.get(r.outputs[0], ())) != 1
            or int(r.attr("mrope_layout", 0)) != 0
            or int(r.attr("rotary_embedding_dim", 0))
            or int(r.attr("is_packed_batching", 0))
            for r in (rq, rk)
        ):
            continue
        assert rq is not None and rk is not None
        section = tuple(int(v) for v in rq.attr("mrope_section", []))
        if (
            rq.inputs[1:] != rk.inputs[1:]
            or tuple(int(v) for v in rk.attr("mrope_section", [])) != section
            or len(section) != 3
            or int(rq.attr("interleaved", 0)) != int(rk.attr("interleaved", 0))
            or any(x not in consts for x in rq.inputs[2:4])
            or sum(section) != consts[rq.inputs[2]].shape[-1]
        ):
            continue
        lins = [producer.get(rq.inputs[0]), producer.get(rk.inputs[0]), producer.get(ins[2])]
        if any(
            p is None
            or p.op != "Linear"
            or p.domain != "onnxgen"
            or len(p.inputs) != 2
            or p.inputs[1] not in consts
            or len(readers.get(p.outputs[0], ())) != 1
            or p.inputs[0] != lins[0].inputs[0]  # type: ignore[union-attr]
            or bool(p.attrs.get("_transposed", 0)) != bool(lins[0].attrs.get("_transposed", 0))  # type: ignore[union-attr]
            or set(p.attrs) - {"_transposed"}
            for p in lins
        ):
            continue
        lq, lk, lv = lins
        assert lq is not None and lk is not None and lv is not None
        t = bool(lq.attrs.get("_transposed", 0))
        ws = [consts[p.inputs[1]] for p in lins]
        n, hkv = int(g.attr("num_heads")), int(g.attr("kv_num_heads"))
        cat = 0 if t else 1
        if (
            len({w.dtype for w in ws}) != 1
            or any(w.dim() != 2 for w in ws)
            or len({w.shape[1 - cat] for w in ws}) != 1
            or ws[0].shape[cat] * hkv != ws[1].shape[cat] * n
            or ws[1].shape != ws[2].shape
        ):
            continue
        key = (rq.inputs[1], rq.inputs[2], rq.inputs[3], section)
        if key not in tables:
            tables[key] = (f"{rq.inputs[1]}::mrope_cos", f"{rq.inputs[1]}::mrope_sin")
            before[id(rq)] = O.Node(
                "MRopeTables",
                O.INTERNAL,
                f"onnxgen/mrope_tables/{len(tables)}",
                list(rq.inputs[1:4]),
                list(tables[key]),
                {"mrope_section": list(section)},
            )
        name = _joined_weight(consts, [p.inputs[1] for p in lins], t, device)
        qkv = f"{lq.outputs[0]}::qkv"
        lq.inputs, lq.outputs = [lq.inputs[0], name], [qkv]
        g.inputs = [qkv, "", "", *ins[3:7], *tables[key], *g.inputs[9:]]
        g.attrs.update(
            do_rotary=1,
            rotary_interleaved=int(rq.attr("interleaved", 0)),
            _step_tables=1,
            _rot_half=int(consts[rq.inputs[2]].shape[-1]),
        )
        drop.update((id(lk), id(lv), id(rq), id(rk)))
    out: list[O.Node] = []
    for n in nodes:
        if id(n) in before:
            out.append(before[id(n)])
        if id(n) not in drop:
            out.append(n)
    return out


def _merge_int4_pair(
    m: O.Node,
    g: O.Node,
    u: O.Node,
    consts: dict[str, torch.Tensor],
    readers: dict[str, list[O.Node]],
    on_device: set[str] | None,
) -> bool:
    """Rewrite SiluMul `m` of packed products `g` and `u` as `Int4LinearSiluMul` (see `_merge_gate_up`);
    False (nothing changed) unless both are bias-free with the same K, N, block and kind of zero point."""
    gi, ui = g.inputs + [""] * (5 - len(g.inputs)), u.inputs + [""] * (5 - len(u.inputs))
    if (
        gi[4]
        or ui[4]
        or bool(gi[3]) != bool(ui[3])
        or any(g.attr(a) != u.attr(a) for a in ("K", "N", "block_size"))
    ):
        return False
    if consts[gi[2]].dtype != consts[ui[2]].dtype or (gi[3] and consts[gi[3]].dtype != consts[ui[3]].dtype):
        return False
    names = []
    for a, b in zip(gi[1:4], ui[1:4], strict=True):
        if not a:
            names.append("")
            continue
        name = f"{a}+{b}"
        if name not in consts:
            consts[name] = torch.cat([consts[a], consts[b]], dim=1)  # [rows, N] side by side: [rows, 2N]
        for half in (a, b):  # no longer read by anyone: free its device copy now, not at placement
            if all(r in (g, u) for r in readers.get(half, ())):
                consts.pop(half, None)
        names.append(name)
        if on_device is not None:
            on_device.add(name)
    m.op, m.inputs = "Int4LinearSiluMul", [gi[0], *names]
    m.attrs = {"K": g.attr("K"), "N": g.attr("N"), "block_size": g.attr("block_size")}
    return True


def _residual_into_product(nodes: list[O.Node], logits: str) -> None:
    """`SkipSimplifiedLayerNormalization(a, b)` where b is the output of a bias-free `Linear` (no rotary) or
    packed `Int4Linear` that nothing else reads -> that product adds a itself (its residual input: the sum
    formed in float32 before the one rounding) and the norm becomes a plain `SimplifiedLayerNormalization`
    of the sum, whose readers of the norm's sum output read the product's output instead. A norm folded
    into the next product then has no skip to load and no sum to store (a shorter loop in the packed fold),
    and a norm left
    on its own reads one row instead of two. In half precision the Triton products (decode and verify rows,
    few-row chunks) round the sum once instead of twice (the product, then the sum): closer to a float32
    reference, not the same bits; cuBLAS rows keep the two roundings (`kernels.linear.linear_unfused`). In
    place."""
    producer = {o: n for n in nodes for o in n.outputs if o}
    at = {id(n): i for i, n in enumerate(nodes)}
    readers = _readers(nodes)
    for n in nodes:
        if not (
            n.op == "SkipSimplifiedLayerNormalization"
            and n.domain == "com.microsoft"
            and (len(n.inputs) < 4 or not any(n.inputs[3:]))
            and len(n.inputs) >= 3
        ):
            continue
        if any(readers.get(o) for o in n.outputs[1:3] if o) or logits in n.outputs[1:]:
            continue
        for i in (1, 0):  # the skip (the projection's output) first
            p = producer.get(n.inputs[i])
            r = readers.get(n.inputs[i], [])
            q = producer.get(n.inputs[1 - i])  # the residual must exist before the product runs
            movable = (
                p is not None
                and p.domain == "onnxgen"
                and (
                    (p.op == "Int4Linear" and not any(p.inputs[4:]))
                    or (p.op == "Linear" and len(p.inputs) == 2 and "_rope" not in p.attrs)
                )
            )
            if movable and len(r) == 1 and r[0] is n and (q is None or at[id(q)] < at[id(p)]):
                break
        else:
            continue
        assert p is not None
        # the residual is input 5 of both (Int4Linear: x, words, scales, zp, bias; Linear: x, w, bias, cos, sin)
        keep = 4 if p.op == "Int4Linear" else 2
        p.inputs = (p.inputs + [""] * 5)[:keep] + [""] * (5 - keep) + [n.inputs[1 - i]]
        total = n.outputs[3] if len(n.outputs) > 3 else ""
        n.op, n.inputs, n.outputs = (
            "SimplifiedLayerNormalization",
            [p.outputs[0], n.inputs[2]],
            [n.outputs[0]],
        )
        n.attrs = {"epsilon": n.attr("epsilon", 1e-5), "axis": -1}
        for r in readers.get(total, []) if total else []:
            r.inputs = [p.outputs[0] if x == total else x for x in r.inputs]


def _fuse_norm_linear(nodes: list[O.Node], consts: dict[str, torch.Tensor]) -> list[O.Node]:
    """`(Skip)SimplifiedLayerNormalization` over the last axis (constant weight, no bias) whose normalised
    output only a Linear / LinearSiluMul (no bias) reads -> `RmsLinear(x, skip, weight, W)` in the norm's
    place, with outputs (the product, the norm's residual sum); read only by a packed Int4Linear (no bias)
    / Int4LinearSiluMul -> `RmsInt4Linear(x, skip, weight, words, scales, zero points)`, the same."""
    readers = _readers(nodes)
    drop: set[int] = set()
    out: list[O.Node] = []
    for n in nodes:
        if id(n) in drop:
            continue
        skip = n.op == "SkipSimplifiedLayerNormalization" and n.domain == "com.microsoft"
        plain = n.op == "SimplifiedLayerNormalization" and n.domain in ("", "com.microsoft")
        users = readers.get(n.outputs[0], []) if n.outputs else []
        lin = users[0] if len(users) == 1 else None
        ok = (
            (skip or (plain and int(n.attr("axis", -1)) == -1))
            and lin is not None
            and "_out_dtype" not in n.attrs
        )
        gamma, int4 = "", False
        if ok:
            assert lin is not None
            gamma = n.inputs[2] if skip else n.inputs[1]
            # packed int4: no bias and no residual (inputs 4 and 5), which RmsInt4Linear would drop
            int4 = lin.op == "Int4LinearSiluMul" or (lin.op == "Int4Linear" and not any(lin.inputs[4:]))
            ok = (
                gamma in consts
                and (not skip or len(n.inputs) < 4 or not n.inputs[3])
                and lin.domain == "onnxgen"
                and lin.inputs[0] == n.outputs[0]
                and not any(readers.get(o) for o in n.outputs[1:3] if o)
                and (
                    int4
                    or (
                        lin.op in ("Linear", "LinearSiluMul")
                        and len(lin.inputs) == 2
                        and lin.inputs[1] in consts
                    )
                )
            )
        if not ok:
            out.append(n)
            continue
        assert lin is not None
        total = n.outputs[3] if skip and len(n.outputs) > 3 else ""
        if int4:  # packed int4: the norm folded into the packed GEMV (`ops.quant`)
            out.append(
                O.Node(
                    "RmsInt4Linear",
                    "onnxgen",
                    f"{n.name}+{lin.name}",
                    [n.inputs[0], n.inputs[1] if skip else "", gamma, *(lin.inputs[1:4] + [""] * 3)[:3]],
                    [lin.outputs[0], total],
                    {
                        "epsilon": float(n.attr("epsilon", 1e-5)),
                        "silu": int(lin.op == "Int4LinearSiluMul"),
                        **{a: lin.attr(a) for a in ("K", "N", "block_size")},
                    },
                )
            )
            drop.add(id(lin))
            continue
        out.append(
            O.Node(
                "RmsLinear",
                "onnxgen",
                f"{n.name}+{lin.name}",
                [n.inputs[0], n.inputs[1] if skip else "", gamma, lin.inputs[1]],
                [lin.outputs[0], total],
                {
                    "epsilon": float(n.attr("epsilon", 1e-5)),
                    "silu": int(lin.op == "LinearSiluMul"),
                    "_transposed": int(lin.attrs.get("_transposed", 0)),
                },
            )
        )
        drop.add(id(lin))
    return out


def _cut_before_final_norm(nodes: list[O.Node]) -> list[O.Node]:
    """`SliceLast(SimplifiedLayerNormalization(x))` read only by a product (the lm_head after the final norm)
    -> `SimplifiedLayerNormalization(SliceLast(x))`: the norm is per position, so the same rows, and the
    norm then reads into the product alone (`_fuse_norm_linear` folds it: no norm launch in a decode
    step; prefill normalises the last row only)."""
    readers = _readers(nodes)
    producer = {o: n for n in nodes for o in n.outputs if o}
    for cut in [n for n in nodes if n.op == "SliceLast" and n.domain == "onnxgen"]:
        norm = producer.get(cut.inputs[0])
        users = readers.get(cut.outputs[0], [])
        if (
            norm is None
            or norm.op != "SimplifiedLayerNormalization"
            or norm.domain not in ("", "com.microsoft")
            or int(norm.attr("axis", -1)) != -1
            or len(readers.get(norm.outputs[0], [])) != 1
            or any(readers.get(o) for o in norm.outputs[1:] if o)
            or len(users) != 1
            or users[0].domain != "onnxgen"
            or users[0].op not in ("Linear", "Int4Linear")
        ):
            continue
        sliced = cut.outputs[0]
        cut.inputs, cut.outputs = [norm.inputs[0]], [norm.inputs[0] + "::last"]
        norm.inputs = [cut.outputs[0], *norm.inputs[1:]]
        norm.outputs = [sliced, *norm.outputs[1:]]  # the product reads the norm's output under the cut's name
        nodes = [n for n in nodes if n is not cut]
        at = next(i for i, n in enumerate(nodes) if n is norm)
        nodes.insert(at, cut)
    return nodes


def _cast_into_product(nodes: list[O.Node]) -> list[O.Node]:
    """`Cast(to=float)` of a bias-free, non-rotary Linear / RmsLinear (no SiLU) output that nothing else
    reads (the lm_head's logits cast to float32) -> the product writes float32 itself (`_out_float`: each
    value rounded to the product's dtype first, so the same values as the Cast), no cast launch."""
    readers = _readers(nodes)
    producer = {o: n for n in nodes for o in n.outputs if o}
    drop: set[int] = set()
    for c in nodes:
        if not (c.op == "Cast" and c.domain == "" and int(c.attr("to", 0)) == 1 and len(c.inputs) == 1):
            continue
        p = producer.get(c.inputs[0])
        if p is None or p.domain != "onnxgen" or len(readers.get(c.inputs[0], [])) != 1 or "_rope" in p.attrs:
            continue
        if (p.op == "Linear" and len(p.inputs) == 2) or (p.op == "RmsLinear" and not p.attrs.get("silu")):
            p.attrs["_out_float"] = 1
            p.outputs = [c.outputs[0], *p.outputs[1:]]
            drop.add(id(c))
    return [n for n in nodes if id(n) not in drop]


def _split_into_gqa(nodes: list[O.Node], consts: dict[str, torch.Tensor]) -> list[O.Node]:
    """`GroupQueryAttention(Split(x) -> q, k, v)` over the last axis in `[n*d, hkv*d, hkv*d]` parts read by
    nothing else (Gemma 3's layout) -> `GroupQueryAttention(x)` with packed QKV: the same values, and the
    attention's fused launch (q/k norms, rotary, KV write) reads the product directly."""
    producer = {o: n for n in nodes for o in n.outputs if o}
    readers = _readers(nodes)
    drop: set[int] = set()
    for g in nodes:
        if not (g.op == "GroupQueryAttention" and g.domain == "com.microsoft" and g.layer is not None):
            continue
        ins = g.inputs + [""] * 3
        sp = producer.get(ins[0])
        if sp is None or sp.op != "Split" or sp.domain != "" or list(sp.outputs) != ins[:3]:
            continue
        sizes = sp.attrs.get("split")
        if sizes is None and len(sp.inputs) > 1 and sp.inputs[1] in consts:
            sizes = consts[sp.inputs[1]].tolist()
        n, hkv = int(g.attr("num_heads")), int(g.attr("kv_num_heads"))
        if (
            sizes is None
            or int(sp.attr("axis", 0)) not in (-1, 2)
            or len(sizes) != 3
            or sizes[0] * hkv != sizes[1] * n
            or sizes[1] != sizes[2]
            or any(len(readers.get(o, ())) != 1 for o in sp.outputs)
        ):
            continue
        g.inputs = [sp.inputs[0], "", "", *g.inputs[3:]]
        drop.add(id(sp))
    return [n for n in nodes if id(n) not in drop]


def _cast_into_norm(nodes: list[O.Node]) -> list[O.Node]:
    """`Cast(to=float16 / bfloat16)` of a (Skip)SimplifiedLayerNormalization's normalised output that nothing
    else reads (a float32 residual stream feeding half-precision products: Gemma's packages) -> the norm
    writes that dtype itself (`_out_dtype`: the float32 value rounded once, the Cast's values)."""
    readers = _readers(nodes)
    producer = {o: n for n in nodes for o in n.outputs if o}
    drop: set[int] = set()
    for c in nodes:
        if not (
            c.op == "Cast" and c.domain == "" and int(c.attr("to", 0)) in (10, 16) and len(c.inputs) == 1
        ):
            continue
        p = producer.get(c.inputs[0])
        if (
            p is None
            or p.op not in ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")
            or p.domain not in ("", "com.microsoft")
            or p.outputs[0] != c.inputs[0]
            or len(readers.get(c.inputs[0], [])) != 1
            or int(p.attr("axis", -1)) != -1
        ):
            continue
        p.attrs["_out_dtype"] = int(c.attr("to"))
        p.outputs = [c.outputs[0], *p.outputs[1:]]
        drop.add(id(c))
    return [n for n in nodes if id(n) not in drop]


def _rope_into_qkv(nodes: list[O.Node], consts: dict[str, torch.Tensor], device: torch.device) -> None:
    """GroupQueryAttention with rotate-half rotary on packed QKV (no separate k/v, bias or q/k norms) whose
    query only a constant-weight Linear / RmsLinear (no bias) produces: the q and k rows (output features)
    of that weight are reordered so that each rotation pair (i, i + half) becomes two adjacent rows, and
    the attention rotates interleaved pairs. Attention scores are unchanged (q and k carry the same
    reordering; v is untouched) and so is every output; the product is told its layer and heads (`_rope`,
    the rotary tables as inputs 4 and 5), so a one-row product can rotate q and k and write k and v itself
    (`ops.linear._qkv_rope`), keeping a whole per-layer launch out of decode steps."""
    producer = {o: n for n in nodes for o in n.outputs if o}
    readers = _readers(nodes)
    for g in nodes:
        if not (
            g.op == "GroupQueryAttention"
            and g.domain == "com.microsoft"
            and g.layer is not None
            and int(g.attr("do_rotary", 0))
            and not int(g.attr("rotary_interleaved", 0))
        ):
            continue
        ins = g.inputs + [""] * 17
        p = producer.get(ins[0])
        if (
            ins[1]
            or ins[2]
            or ins[10]
            or ins[14]
            or ins[15]
            or p is None
            or p.domain != "onnxgen"
            or len(readers.get(ins[0], ())) != 1
            or not (g.attrs.get("_step_tables") or (ins[7] in consts and ins[8] in consts))
        ):
            continue
        if p.op == "Linear" and len(p.inputs) == 2:
            wi = 1
        elif p.op == "RmsLinear" and not p.attrs.get("silu"):
            wi = 3
        else:
            continue
        w = consts.get(p.inputs[wi])
        axis = 0 if p.attrs.get("_transposed") else 1  # `[N, K]`, or `[K, N]` (the CPU's float32 layout)
        n, hkv = int(g.attr("num_heads")), int(g.attr("kv_num_heads"))
        half = int(g.attrs["_rot_half"]) if g.attrs.get("_step_tables") else int(consts[ins[7]].shape[-1])
        if w is None or w.dim() != 2 or w.shape[axis] % (n + 2 * hkv):
            continue
        d = w.shape[axis] // (n + 2 * hkv)
        if d % 2 or not 0 < 2 * half <= d:
            continue
        lane = torch.arange(d)
        pair = torch.where(
            lane < 2 * half, lane // 2 + (lane % 2) * half, lane
        )  # new lane j holds old lane pair[j]
        rows = torch.cat(
            [(h * d + pair) for h in range(n + hkv)] + [torch.arange((n + hkv) * d, w.shape[axis])]
        )
        name = p.inputs[wi] + "::rope"
        src = w.to(device) if device.type == "cuda" else w
        consts[name] = src.index_select(axis, rows.to(src.device)).contiguous()
        bias_slot = [""] if p.op == "Linear" else []  # Linear's third input is its (absent) bias
        p.inputs = [*p.inputs[:wi], name, *bias_slot, ins[7], ins[8]]
        p.attrs["_rope"] = (g.layer, n, hkv, d)
        if "_rope_switch" in g.attrs:
            p.attrs["_rope_switch"] = g.attrs["_rope_switch"]
        if g.attrs.get("_step_tables"):
            p.attrs["_step_tables"] = 1
        g.attrs["rotary_interleaved"] = 1


# --- folding & DCE ------------------------------------------------------------------------------------


def _fold_constants(nodes: list[O.Node], consts: dict[str, torch.Tensor]) -> list[O.Node]:
    out = []
    for n in nodes:
        if (
            n.op in _NOT_FOLDABLE
            or (n.domain == "onnxgen" and n.op != "IfConst")
            or (n.domain == "com.microsoft" and n.op in ("MatMulNBits", "GatherBlockQuantized"))
            or not all((not x) or x in consts for x in n.inputs)
        ):
            out.append(n)
            continue
        fn = O.builder(n)(n)
        args = [consts[x] if x else None for x in n.inputs]
        while args and args[-1] is None:
            args.pop()
        res = fn(None, *args)
        for name, val in zip(n.outputs, res, strict=False):
            if name and val is not None:
                consts[name] = val
    return out


def _dce(nodes: list[O.Node], outputs: list[str]) -> list[O.Node]:
    need = set(outputs)
    keep = []
    for n in reversed(nodes):
        if any(o in need for o in n.outputs if o) or n.layer is not None:
            keep.append(n)
            need.update(x for x in n.inputs if x)
    keep.reverse()
    return keep


def describe(program: Program) -> str:
    return f"{len(program.steps)} steps, {program.weight_bytes / 1e9:.2f} GB weights, ops: {', '.join(program.info['ops'])}"
