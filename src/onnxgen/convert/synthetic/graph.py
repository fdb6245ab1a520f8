"""An ONNX graph under construction: nodes in order, Constant nodes named as the model builder names
them, and initializers as specs whose values are produced later (streamed into the external data).

onnx is imported lazily (inside the methods).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onnxgen.convert.synthetic.arrays import ONNX_FLOAT_TYPES

_UINT8 = 2  # onnx TensorProto.UINT8


@dataclass
class Initializer:
    """A weight the graph reads: its name, shape and onnx type, and how to make its value.

    `produce()` returns a numpy array or torch tensor of `shape` (any float dtype when `dtype` is set,
    cast to it on writing; raw, e.g. uint8, when `dtype` is None). It is called once, possibly from a
    worker thread.
    """

    name: str
    shape: tuple[int, ...]
    elem: int  # onnx TensorProto type
    dtype: str | None  # target float dtype name, None: the produced array's bytes as they are
    produce: Callable[[], Any]


@dataclass
class Graph:
    """Nodes, constants and initializer specs of one graph whose float tensors are `dtype`. Append-only:
    the order of calls is the order of nodes and of initializers in the file."""

    dtype: str
    nodes: list[Any] = field(default_factory=list)
    inits: list[Initializer] = field(default_factory=list)
    consts: dict[str, str] = field(default_factory=dict)

    @property
    def elem(self) -> int:
        """The onnx TensorProto type of the model dtype."""
        return ONNX_FLOAT_TYPES[self.dtype]

    def node(
        self,
        op: str,
        inputs: list[str],
        name: str,
        n_out: int = 1,
        domain: str = "",
        outputs: list[str] | None = None,
        **attrs: Any,
    ) -> Any:
        """Append a node; returns its output name (a list of names when it has several). Outputs are
        named `NAME/output_i` unless `outputs` names them ("" for an omitted optional output)."""
        from onnx import helper

        outs = outputs if outputs is not None else [f"{name}/output_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=name, domain=domain or None, **attrs))
        return outs[0] if len(outs) == 1 else outs

    def const(self, value: Any, kind: str) -> str:
        """A Constant node (builder naming /model/constants/KIND/value), made once per (kind, value);
        kind INT64, INT32, FLOAT, or 'T' (the model dtype). Returns its output name."""
        from onnx import helper, numpy_helper

        if kind == "T":
            kind = {"float32": "FLOAT", "float16": "FLOAT16", "bfloat16": "BFLOAT16"}[self.dtype]
        key = f"/model/constants/{kind}/{value}"
        if key in self.consts:
            return self.consts[key]
        if kind == "BFLOAT16":
            tensor = helper.make_tensor(
                key, 16, np.shape(value), np.asarray(value, np.float32).reshape(-1).tolist()
            )
        else:
            npd = {"INT64": np.int64, "INT32": np.int32, "FLOAT": np.float32, "FLOAT16": np.float16}[kind]
            tensor = numpy_helper.from_array(np.asarray(value, dtype=npd), key)
        name = key.replace("/constants/", "/constant_nodes/")
        self.nodes.append(helper.make_node("Constant", [], [key], name=name, value=tensor))
        self.consts[key] = key
        return key

    def init(
        self, name: str, shape: tuple[int, ...], produce: Callable[[], Any], dtype: str | None = "model"
    ) -> str:
        """Register an initializer (see `Initializer`): `dtype` "model" (the graph's dtype), another float
        dtype name, or None for raw uint8. Returns its name."""
        d = self.dtype if dtype == "model" else dtype
        elem = ONNX_FLOAT_TYPES[d] if d is not None else _UINT8
        self.inits.append(Initializer(name, tuple(int(s) for s in shape), elem, d, produce))
        return name

    def model_proto(self, inputs: list[Any], outputs: list[Any], opset: int) -> Any:
        """The ModelProto of the nodes so far (initializers not attached): ai.onnx `opset`, plus
        com.microsoft 1 when a node uses it."""
        from onnx import helper

        graph = helper.make_graph(self.nodes, "main_graph", inputs, outputs)
        imports = [helper.make_opsetid("", opset)]
        if any(n.domain == "com.microsoft" for n in self.nodes):
            imports.append(helper.make_opsetid("com.microsoft", 1))
        return helper.make_model(
            graph, opset_imports=imports, producer_name="onnxgen.synthetic", ir_version=10
        )
