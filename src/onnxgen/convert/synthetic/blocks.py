"""The parts of a synthetic Llama graph every style shares: the package's inputs and outputs, the
embedding, linear layers (float MatMul or int4 MatMulNBits), the SiLU MLP, the lm_head and the rotary
caches. A style module (`gqa`, `plain`) strings them together with its own attention and norms.

Node and weight names follow onnxruntime-genai's model builder (`/model/layers.{i}/...`,
`model.layers.{i}.mlp.gate_proj.MatMul.weight`, ...), so fixtures look like real packages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from onnxgen.convert.synthetic.arrays import as_np, cat, transpose
from onnxgen.convert.synthetic.config import SyntheticConfig
from onnxgen.convert.synthetic.graph import Graph
from onnxgen.convert.synthetic.quant import BLOCK_SIZE, quantize_int4
from onnxgen.convert.synthetic.weights import WeightSource


def rope_caches(cfg: SyntheticConfig, full: bool) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin `[context, head/2]` (builder layout) or `[context, head]` (HF layout, `full`)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
    t = np.arange(cfg.context_length, dtype=np.float32)
    freqs = np.outer(t, inv_freq).astype(np.float32)
    if full:
        freqs = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)


class Builder:
    """Appends shared Llama parts to `self.g` for one config, reading weights from `src` lazily (each
    initializer's producer calls `src.get` when the data file is written).

    Tied float embeddings are stored once, as the style's reference does: the builder style ("gqa")
    keeps `lm_head.MatMul.weight` [H, V] and gathers the embedding from its Transpose; the ai.onnx
    styles keep `model.embed_tokens.weight` [V, H] and multiply by its Transpose in the lm_head.
    """

    def __init__(self, cfg: SyntheticConfig, src: WeightSource) -> None:
        self.cfg = cfg
        self.src = src
        self.g = Graph(cfg.dtype)

    # -- weights --

    def linear(
        self,
        base: str,
        x: str,
        hf_names: list[str],
        onnx_weight: str,
        out_features: int,
        output: str | None = None,
    ) -> str:
        """`x @ W.T` for W = concat(hf_names) [out, in]: float MatMul or MatMulNBits. Returns its output."""
        cfg, g, src = self.cfg, self.g, self.src
        k = (
            cfg.hidden_size
            if not hf_names[0].endswith(("o_proj.weight", "down_proj.weight"))
            else (cfg.q_size if hf_names[0].endswith("o_proj.weight") else cfg.intermediate_size)
        )
        if cfg.quant is None:
            w = g.init(
                onnx_weight, (k, out_features), lambda: transpose(cat([src.get(n) for n in hf_names], 0))
            )
            return g.node("MatMul", [x, w], f"{base}/MatMul", outputs=[output] if output else None)
        q = self.quant_weight(onnx_weight, out_features, k, lambda: cat([src.get(n) for n in hf_names], 0))
        return g.node(
            "MatMulNBits",
            [x, *q],
            f"{base}/MatMul_Q4",
            domain="com.microsoft",
            outputs=[output] if output else None,
            K=k,
            N=out_features,
            bits=4,
            block_size=BLOCK_SIZE,
            accuracy_level=cfg.accuracy_level,
        )

    def quant_weight(self, weight: str, n: int, k: int, get: Callable[[], Any]) -> list[str]:
        """Register `weight`_Q4 / _scales (/ _zero_points) initializers for W [n, k]; returns their names.

        W is quantized once, when the first of them is written, and dropped after the last one.
        """
        cfg, g = self.cfg, self.g
        nb = -(-k // BLOCK_SIZE)
        cache: dict[str, Any] = {}

        def q() -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
            if "q" not in cache:
                cache["q"] = quantize_int4(as_np(get()), cfg.quant_zero_points)
            return cache["q"]

        def take(i: int) -> Callable[[], Any]:
            def f() -> Any:
                r = q()[i]
                if i == 2 or (i == 1 and not cfg.quant_zero_points):
                    cache.pop("q", None)  # last consumer: free
                return r.reshape(-1) if i else r

            return f

        names = [
            g.init(f"{weight}_Q4", (n, nb, BLOCK_SIZE // 2), take(0), dtype=None),
            g.init(f"{weight}_scales", (n * nb,), take(1)),
        ]
        if cfg.quant_zero_points:
            names.append(g.init(f"{weight}_zero_points", (n * ((nb + 1) // 2),), take(2), dtype=None))
        return names

    def norm_weight(self, onnx_name: str, hf_name: str) -> str:
        return self.g.init(onnx_name, (self.cfg.hidden_size,), lambda: self.src.get(hf_name))

    # -- shared subgraphs --

    def embedding(self) -> str:
        """`input_ids` -> hidden states [B, S, H] (Gather or GatherBlockQuantized), plus a zero term
        per extra input so onnxruntime demands it. Returns the output name."""
        cfg, g, src = self.cfg, self.g, self.src
        base = "/model/embed_tokens"
        if cfg.quant_embeddings:
            k, v = cfg.hidden_size, cfg.vocab_size
            nb = -(-k // BLOCK_SIZE)
            if cfg.tie_embeddings:
                # Share lm_head's MatMulNBits weights (builder: Reshape -> GatherBlockQuantized).
                names = ["lm_head.MatMul.weight_Q4", "lm_head.MatMul.weight_scales"]
                if cfg.quant_zero_points:
                    names.append("lm_head.MatMul.weight_zero_points")
                data = g.node(
                    "Reshape", [names[0], g.const([v, nb * BLOCK_SIZE // 2], "INT64")], f"{base}/Reshape"
                )
                scales = g.node("Reshape", [names[1], g.const([v, nb], "INT64")], f"{base}/Reshape_1")
                ins = [data, "input_ids", scales]
                if cfg.quant_zero_points:
                    ins.append(
                        g.node(
                            "Reshape", [names[2], g.const([v, (nb + 1) // 2], "INT64")], f"{base}/Reshape_2"
                        )
                    )
            else:
                qn = self.quant_weight(
                    "model.embed_tokens.weight", v, k, lambda: src.get("model.embed_tokens.weight")
                )
                data = g.node(
                    "Reshape", [qn[0], g.const([v, nb * BLOCK_SIZE // 2], "INT64")], f"{base}/Reshape"
                )
                ins = [
                    data,
                    "input_ids",
                    g.node("Reshape", [qn[1], g.const([v, nb], "INT64")], f"{base}/Reshape_1"),
                ]
                if cfg.quant_zero_points:
                    ins.append(
                        g.node("Reshape", [qn[2], g.const([v, (nb + 1) // 2], "INT64")], f"{base}/Reshape_2")
                    )
            out = g.node(
                "GatherBlockQuantized",
                ins,
                f"{base}/GatherBlockQuantized",
                domain="com.microsoft",
                bits=4,
                block_size=BLOCK_SIZE,
                gather_axis=0,
                quantize_axis=1,
            )
            if nb * BLOCK_SIZE != k:
                out = g.node(
                    "Slice",
                    [out, g.const([0], "INT64"), g.const([k], "INT64"), g.const([-1], "INT64")],
                    f"{base}/Slice",
                )
        elif cfg.tie_embeddings and cfg.quant is None and cfg.attention == "gqa":
            tr = g.node("Transpose", ["lm_head.MatMul.weight"], f"{base}/Transpose", perm=[1, 0])
            out = g.node("Gather", [tr, "input_ids"], f"{base}/Gather")
        else:
            w = g.init(
                "model.embed_tokens.weight",
                (cfg.vocab_size, cfg.hidden_size),
                lambda: src.get("model.embed_tokens.weight"),
            )
            out = g.node("Gather", [w, "input_ids"], f"{base}/Gather")
        for name in cfg.extra_inputs:
            # Consume the extra input so onnxruntime demands it: embeddings + ReduceMean(x) * 0.
            b = f"/model/extra_inputs/{name}"
            m = g.node("ReduceMean", [name, g.const([1, 2, 3], "INT64")], f"{b}/ReduceMean", keepdims=1)
            m = g.node("Reshape", [m, g.const([-1, 1, 1], "INT64")], f"{b}/Reshape")
            z = g.node("Mul", [m, g.const(0.0, "FLOAT")], f"{b}/Mul")
            if cfg.dtype != "float32":
                z = g.node("Cast", [z], f"{b}/Cast", to=g.elem)
            out = g.node("Add", [out, z], f"{b}/Add")
        return out

    def mlp(self, i: int, x: str) -> str:
        """Layer `i`'s down(SiLU(gate(x)) * up(x)), SiLU as Sigmoid*Mul. Returns the output name."""
        cfg, g = self.cfg, self.g
        b = f"/model/layers.{i}/mlp"
        p = f"model.layers.{i}.mlp."
        gate = self.linear(
            f"{b}/gate_proj",
            x,
            [p + "gate_proj.weight"],
            f"{p}gate_proj.MatMul.weight",
            cfg.intermediate_size,
        )
        up = self.linear(
            f"{b}/up_proj", x, [p + "up_proj.weight"], f"{p}up_proj.MatMul.weight", cfg.intermediate_size
        )
        sig = g.node("Sigmoid", [gate], f"{b}/act_fn/Sigmoid")
        act = g.node("Mul", [gate, sig], f"{b}/act_fn/Mul")
        prod = g.node("Mul", [act, up], f"{b}/Mul")
        return self.linear(
            f"{b}/down_proj", prod, [p + "down_proj.weight"], f"{p}down_proj.MatMul.weight", cfg.hidden_size
        )

    def lm_head(self, x: str) -> None:
        """Final hidden states -> the `logits` output (cast to float32 for bfloat16 models)."""
        cfg, g, src = self.cfg, self.g, self.src
        head = "lm_head.weight" if not cfg.tie_embeddings else "model.embed_tokens.weight"
        final = "logits" if cfg.dtype != "bfloat16" else None
        if cfg.quant is None and cfg.tie_embeddings and cfg.attention != "gqa":
            wt = g.node("Transpose", ["model.embed_tokens.weight"], "/lm_head/Transpose", perm=[1, 0])
            out = g.node("MatMul", [x, wt], "/lm_head/MatMul", outputs=[final] if final else None)
        elif cfg.quant is None:
            w = g.init(
                "lm_head.MatMul.weight", (cfg.hidden_size, cfg.vocab_size), lambda: transpose(src.get(head))
            )
            out = g.node("MatMul", [x, w], "/lm_head/MatMul", outputs=[final] if final else None)
        else:
            q = self.quant_weight(
                "lm_head.MatMul.weight", cfg.vocab_size, cfg.hidden_size, lambda: src.get(head)
            )
            out = g.node(
                "MatMulNBits",
                [x, *q],
                "/lm_head/MatMul_Q4",
                domain="com.microsoft",
                outputs=[final] if final else None,
                K=cfg.hidden_size,
                N=cfg.vocab_size,
                bits=4,
                block_size=BLOCK_SIZE,
                accuracy_level=cfg.accuracy_level,
            )
        if final is None:
            g.node("Cast", [out], "/lm_head/Cast", outputs=["logits"], to=1)

    # -- the model --

    def model_proto(self) -> Any:
        """The ModelProto of the graph built so far, with the package's inputs and outputs (initializers
        not attached): `input_ids`, `attention_mask`, `position_ids` (ai.onnx styles),
        `past_key_values.%d.key/value` [B, kv_heads, past, head], the extra inputs; `logits`
        (float32 for bfloat16 models) and `present.%d.key/value`."""
        from onnx import TensorProto, helper

        cfg = self.cfg
        t = self.g.elem
        kvshape = ["batch_size", cfg.num_kv_heads, "past_sequence_length", "kv_cache_dim"]
        pshape = ["batch_size", cfg.num_kv_heads, "total_sequence_length", "kv_cache_dim"]
        inputs = [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
            helper.make_tensor_value_info(
                "attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"]
            ),
        ]
        if cfg.attention != "gqa":
            inputs.append(
                helper.make_tensor_value_info(
                    "position_ids", TensorProto.INT64, ["batch_size", "sequence_length"]
                )
            )
        for kind in ("key", "value"):
            for i in range(cfg.num_layers):
                inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", t, kvshape))
        for name in cfg.extra_inputs:
            inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch_size", 3, 8, 8]))
        logits_t = TensorProto.FLOAT if cfg.dtype == "bfloat16" else t
        outputs = [
            helper.make_tensor_value_info(
                "logits", logits_t, ["batch_size", "sequence_length", cfg.vocab_size]
            )
        ]
        for kind in ("key", "value"):
            for i in range(cfg.num_layers):
                outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", t, pshape))
        return self.g.model_proto(inputs, outputs, opset=23 if cfg.attention == "onnx23" else 22)
