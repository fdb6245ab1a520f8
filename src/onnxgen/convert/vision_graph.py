"""The vision encoder and embedding graphs of a Qwen2.5-VL package, written from a checkpoint's weights in
the layout onnxruntime-genai runs (one image per vision run):

    vision.onnx     pixel_values [patches, 3*T*P*P] float32, image_grid_thw [1, 3] int64
                    -> image_features [patches / merge^2, out_hidden]
    embedding.onnx  input_ids [B, S] int64, image_features [K, hidden] float32 -> inputs_embeds [B, S, hidden]

The encoder is transformers' `Qwen2_5_VisionTransformerPretrainedModel` as ONNX ops: the patch embedding (its
Conv3d, kernel = stride, is one product over the flattened patch), the 2-D rotary table of each patch's
(row, column) computed in the graph from the grid, blocks of RMSNorm, attention and a gated SiLU MLP, and the
patch merger (RMSNorm, 2x2 patches concatenated, Linear-GELU-Linear). transformers runs windowed layers by
reordering patches into windows and attending within each; here every layer attends over the patches in
their own order under a mask that allows the same window (windowed layers) or the same frame (full layers):
the same function, since attention, norms and MLPs treat patches alike and each keeps its own rotary angles.
The embedding graph gathers the token embeddings and puts the k-th image feature row at the k-th
`image_token_id` of the sequence (what transformers' `masked_scatter` does).

Weights come as a dict of numpy arrays under transformers' names (`model.visual.*`, the text embedding).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

OPSET = 21


class _Graph:
    """Nodes and initializers under construction (names are made unique by a counter)."""

    def __init__(self) -> None:
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self._n = 0

    def const(self, value: Any, dtype: Any = np.float32) -> str:
        from onnx import numpy_helper

        self._n += 1
        name = f"c{self._n}"
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op: str, *inputs: str, domain: str = "", outputs: int = 1, **attrs: Any) -> Any:
        from onnx import helper

        self._n += 1
        outs = [f"{op}_{self._n}_{i}" for i in range(outputs)]
        self.nodes.append(
            helper.make_node(op, list(inputs), outs, name=f"{op}_{self._n}", domain=domain, **attrs)
        )
        return outs[0] if outputs == 1 else outs

    def linear(self, x: str, w: np.ndarray, b: np.ndarray | None = None) -> str:
        """x @ w.T (+ b): w is a torch Linear weight `[out, in]`."""
        y = self.op("MatMul", x, self.const(np.ascontiguousarray(w.T)))
        return self.op("Add", y, self.const(b)) if b is not None else y

    def rms(self, x: str, w: np.ndarray, eps: float = 1e-6) -> str:
        return self.op("SimplifiedLayerNormalization", x, self.const(w), axis=-1, epsilon=eps)

    def model(self, inputs: list[Any], outputs: list[Any], name: str) -> Any:
        from onnx import helper

        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.inits)
        return helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)],
            ir_version=10,
        )


def vision_graph(
    weights: Mapping[str, np.ndarray], cfg: Mapping[str, Any], prefix: str = "model.visual."
) -> Any:
    """The vision encoder as an onnx ModelProto. `cfg`: the checkpoint's `vision_config` (hidden_size,
    num_heads, depth, patch_size, spatial_merge_size, window_size, fullatt_block_indexes, rope_theta in
    `rope_parameters`)."""
    from onnx import TensorProto, helper

    w = {
        k[len(prefix) :]: np.asarray(v, dtype=np.float32) for k, v in weights.items() if k.startswith(prefix)
    }
    g = _Graph()
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_heads"])
    hd, merge, patch = hidden // heads, int(cfg["spatial_merge_size"]), int(cfg["patch_size"])
    window = int(cfg["window_size"]) // merge // patch
    theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    i64 = np.int64

    def scalar(v: int) -> str:
        return g.const(v, i64)

    # patch embedding: Conv3d with kernel = stride over [C, T, P, P] is a product over the flattened patch
    conv = w["patch_embed.proj.weight"]
    x = g.op("MatMul", "pixel_values", g.const(conv.reshape(conv.shape[0], -1).T.copy()))

    # each patch's (row, column) in the image, from its index: patches come merge-block by merge-block
    n = g.op("Gather", g.op("Shape", "pixel_values"), scalar(0), axis=0)
    idx = g.op("Range", scalar(0), n, scalar(1))
    grid = g.op("Reshape", "image_grid_thw", g.const([3], i64))
    hm = g.op("Div", g.op("Gather", grid, scalar(1), axis=0), scalar(merge))
    wm = g.op("Div", g.op("Gather", grid, scalar(2), axis=0), scalar(merge))
    block, within = g.op("Div", idx, scalar(merge * merge)), g.op("Mod", idx, scalar(merge * merge))
    per_frame = g.op("Div", block, g.op("Mul", hm, wm))  # the frame a patch belongs to
    bh = g.op("Mod", g.op("Div", block, wm), hm)
    bw = g.op("Mod", block, wm)
    hpos = g.op("Add", g.op("Mul", bh, scalar(merge)), g.op("Div", within, scalar(merge)))
    wpos = g.op("Add", g.op("Mul", bw, scalar(merge)), g.op("Mod", within, scalar(merge)))

    # rotary angles: a quarter of the head rotates by the row, a quarter by the column, each twice
    inv = 1.0 / theta ** (np.arange(0, hd // 2, 2, dtype=np.float32) / (hd // 2))
    inv_c = g.const(inv[None, :])

    def angles(pos: str) -> str:
        return g.op(
            "Mul", g.op("Unsqueeze", g.op("Cast", pos, to=TensorProto.FLOAT), g.const([1], i64)), inv_c
        )

    half = g.op("Concat", angles(hpos), angles(wpos), axis=1)
    emb = g.op("Unsqueeze", g.op("Concat", half, half, axis=1), g.const([1], i64))  # [N, 1, hd]
    cos, sin = g.op("Cos", emb), g.op("Sin", emb)

    # masks: full layers attend within a frame, windowed ones within a window of `window` merge blocks
    def same(a: str) -> str:
        eq = g.op("Equal", g.op("Unsqueeze", a, g.const([1], i64)), g.op("Unsqueeze", a, g.const([0], i64)))
        return g.op("Where", eq, g.const(0.0), g.const(-np.inf))

    big = 1 << 20
    win_id = g.op(
        "Add",
        g.op(
            "Mul",
            g.op("Add", g.op("Mul", per_frame, scalar(big)), g.op("Div", bh, scalar(window))),
            scalar(big),
        ),
        g.op("Div", bw, scalar(window)),
    )
    full_mask, win_mask = same(per_frame), same(win_id)

    def rotate(t: str) -> str:
        a, b = g.op("Split", t, g.const([hd // 2, hd // 2], i64), axis=-1, outputs=2)
        rot = g.op("Concat", g.op("Neg", b), a, axis=-1)
        return g.op("Add", g.op("Mul", t, cos), g.op("Mul", rot, sin))

    full = set(int(i) for i in cfg["fullatt_block_indexes"])
    for layer in range(int(cfg["depth"])):
        p = f"blocks.{layer}."
        h = g.rms(x, w[p + "norm1.weight"])
        qkv = g.op(
            "Reshape",
            g.linear(h, w[p + "attn.qkv.weight"], w[p + "attn.qkv.bias"]),
            g.const([0, 3, heads, hd], i64),
        )
        q, k, v = (g.op("Gather", qkv, scalar(i), axis=1) for i in range(3))  # [N, H, hd]
        q = g.op("Transpose", rotate(q), perm=[1, 0, 2])
        k = g.op("Transpose", rotate(k), perm=[1, 2, 0])
        v = g.op("Transpose", v, perm=[1, 0, 2])
        scores = g.op(
            "Add",
            g.op("Mul", g.op("MatMul", q, k), g.const(hd**-0.5)),
            full_mask if layer in full else win_mask,
        )
        att = g.op("MatMul", g.op("Softmax", scores, axis=-1), v)  # [H, N, hd]
        att = g.op("Reshape", g.op("Transpose", att, perm=[1, 0, 2]), g.const([0, hidden], i64))
        x = g.op("Add", x, g.linear(att, w[p + "attn.proj.weight"], w[p + "attn.proj.bias"]))
        h = g.rms(x, w[p + "norm2.weight"])
        gate = g.linear(h, w[p + "mlp.gate_proj.weight"], w[p + "mlp.gate_proj.bias"])
        up = g.linear(h, w[p + "mlp.up_proj.weight"], w[p + "mlp.up_proj.bias"])
        act = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up)
        x = g.op("Add", x, g.linear(act, w[p + "mlp.down_proj.weight"], w[p + "mlp.down_proj.bias"]))

    y = g.op("Reshape", g.rms(x, w["merger.ln_q.weight"]), g.const([-1, hidden * merge * merge], i64))
    y = g.linear(y, w["merger.mlp.0.weight"], w["merger.mlp.0.bias"])
    y = g.op(
        "Mul",
        g.op("Mul", y, g.const(0.5)),
        g.op("Add", g.op("Erf", g.op("Mul", y, g.const(2**-0.5))), g.const(1.0)),
    )
    w2, b2 = w["merger.mlp.2.weight"], w["merger.mlp.2.bias"]
    out = g.op("Add", g.op("MatMul", y, g.const(np.ascontiguousarray(w2.T))), g.const(b2))
    g.nodes.append(helper.make_node("Identity", [out], ["image_features"], name="image_features"))
    patch_dim = conv[0].size
    return g.model(
        [
            helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, ["num_patches", patch_dim]),
            helper.make_tensor_value_info("image_grid_thw", TensorProto.INT64, [1, 3]),
        ],
        [
            helper.make_tensor_value_info(
                "image_features", TensorProto.FLOAT, ["num_image_tokens", w2.shape[0]]
            )
        ],
        "qwen2_5_vl_vision",
    )


def embedding_graph(table: np.ndarray, image_token_id: int) -> Any:
    """The embedding graph over the token embedding `table` `[vocab, hidden]`: each id's row, except that the
    k-th `image_token_id` of the sequence takes row k of `image_features` (which may have zero rows)."""
    from onnx import TensorProto, helper

    g = _Graph()
    hidden = table.shape[1]
    i64 = np.int64
    emb = g.op("Gather", g.const(table), "input_ids", axis=0)  # [B, S, hidden]
    is_img = g.op("Equal", "input_ids", g.const(image_token_id, i64))
    nth = g.op(
        "Sub", g.op("CumSum", g.op("Cast", is_img, to=TensorProto.INT64), g.const(1, i64)), g.const(1, i64)
    )
    count = g.op("Gather", g.op("Shape", "image_features"), g.const(0, i64), axis=0)
    rows = g.op("Concat", "image_features", g.const(np.zeros((1, hidden), np.float32)), axis=0)
    picked = g.op("Gather", rows, g.op("Where", is_img, nth, count), axis=0)
    out = g.op("Where", g.op("Unsqueeze", is_img, g.const([-1], i64)), picked, emb)
    g.nodes.append(helper.make_node("Identity", [out], ["inputs_embeds"], name="inputs_embeds"))
    return g.model(
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
            helper.make_tensor_value_info("image_features", TensorProto.FLOAT, ["num_image_tokens", hidden]),
        ],
        [
            helper.make_tensor_value_info(
                "inputs_embeds", TensorProto.FLOAT, ["batch_size", "sequence_length", hidden]
            )
        ],
        "qwen2_5_vl_embedding",
    )
