"""What the ort decoder reads from and adds to its ONNX graph at load: `graph_facts` (GroupQueryAttention,
its largest sliding window, LongRoPE's switch length: `GraphFacts`), `last_position_graph` (the lm_head sees
only the positions whose logits are wanted, from the added input `LOGITS_FROM`) and `open_session`, the
InferenceSession over the (possibly rewritten) graph."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from onnxgen.package.spec import ModelSpec

LOGITS_FROM = "onnxgen_logits_from"  # the input last_position_graph adds: -(rows of logits wanted)


def last_position_graph(model: Any, logits_name: str) -> bool:
    """Rewrite `model` (in place) so the lm_head sees only the last positions: a Slice of the hidden
    states before the MatMul that produces the logits (possibly through a Cast), from the new input
    `LOGITS_FROM` (`[-rows]`: one row for a step, more to verify drafts). Prefill then never computes a
    `[seq, vocab]` product. Returns False (model untouched) if the pattern is not found."""
    from onnx import TensorProto, helper

    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    node = producer.get(logits_name)
    if node is not None and node.op_type == "Cast":
        node = producer.get(node.input[0])
    if node is None or node.op_type not in ("MatMul", "MatMulNBits", "Gemm"):
        return False
    hidden = node.input[0]
    prefix = "/onnxgen/last_position"
    graph.input.append(helper.make_tensor_value_info(LOGITS_FROM, TensorProto.INT64, [1]))
    graph.initializer.extend(
        [
            helper.make_tensor(f"{prefix}/ends", TensorProto.INT64, [1], [2**62]),
            helper.make_tensor(f"{prefix}/axes", TensorProto.INT64, [1], [1]),
        ]
    )
    sliced = f"{prefix}/output"
    at = list(graph.node).index(node)
    graph.node.insert(
        at,
        helper.make_node(
            "Slice", [hidden, LOGITS_FROM, f"{prefix}/ends", f"{prefix}/axes"], [sliced], name=prefix
        ),
    )
    node.input[0] = sliced
    return True


@dataclass(frozen=True)
class GraphFacts:
    """What the decoder needs to know about its graph beyond the spec.

    gqa: attention is GroupQueryAttention. window: the largest `local_window_size` of a GroupQueryAttention
    node (0: none); every KV buffer must hold at least that many positions. rope_switch: LongRoPE's
    threshold (the graph uses the long rotary caches when the total length exceeds it; None: no switch).
    """

    gqa: bool = False
    window: int = 0
    rope_switch: int | None = None


def graph_facts(graph: Any) -> GraphFacts:
    """Read `GraphFacts` from an onnx GraphProto (weights not needed)."""
    from onnx import helper, numpy_helper

    producer = {o: n for n in graph.node for o in n.output}
    consts = {i.name: i for i in graph.initializer}
    gqa, window = False, 0
    for node in graph.node:
        if node.op_type == "GroupQueryAttention":
            gqa = True
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            window = max(window, int(attrs.get("local_window_size", -1)))

    def constant(name: str) -> int | None:
        if name in consts:
            v = numpy_helper.to_array(consts[name])
        else:
            n = producer.get(name)
            if n is None or n.op_type != "Constant" or not n.attribute:
                return None
            v = numpy_helper.to_array(n.attribute[0].t)
        return int(v.reshape(-1)[0]) if v.size == 1 else None

    def from_mask_length(name: str) -> bool:
        """`name` is Gather(Shape(attention_mask), 1) (possibly through a Cast)."""
        n = producer.get(name)
        if n is not None and n.op_type == "Cast":
            n = producer.get(n.input[0])
        if n is None or n.op_type != "Gather" or constant(n.input[1]) != 1:
            return False
        shape = producer.get(n.input[0])
        return shape is not None and shape.op_type == "Shape" and shape.input[0] == "attention_mask"

    switch = None
    for node in graph.node:
        if node.op_type != "If" or not any("cos_cache" in o for o in node.output):
            continue
        cond = producer.get(node.input[0])
        if cond is not None and cond.op_type == "Greater" and from_mask_length(cond.input[0]):
            switch = constant(cond.input[1])
    return GraphFacts(gqa=gqa, window=max(window, 0), rope_switch=switch)


def open_session(
    spec: ModelSpec, opts: Any, providers: list[str], last_logits: bool
) -> tuple[Any, GraphFacts, bool]:
    """Create the InferenceSession; returns (session, facts about its graph, last-position logits)."""
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(spec.decoder_path), load_external_data=False)
    facts = graph_facts(model.graph)
    if last_logits and last_position_graph(model, spec.logits_name):
        # the graph comes from memory; its external weights stay in the package folder
        opts.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", str(spec.decoder_path.parent)
        )
        return ort.InferenceSession(model.SerializeToString(), opts, providers=providers), facts, True
    return ort.InferenceSession(str(spec.decoder_path), opts, providers=providers), facts, False
