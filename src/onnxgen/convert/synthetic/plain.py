"""The ai.onnx graph styles, which share one layer loop and differ in attention, rotary and norm:

- "plain": only opset-22 ops, like an optimum export. RoPE by Gather of full-width cos/sin caches at
  `position_ids`, Concat(past, new) -> `present.%d.key/value`, MatMul/Softmax attention (GQA by a
  5-D reshape), RMSNorm from Pow/ReduceMean/Sqrt/Div.
- "onnx23": opset-23 `RotaryEmbedding` (half-width caches), `Attention` (past/present KV as "plain")
  and `RMSNormalization`.

Both take a causal+padding additive mask built from `attention_mask`.
"""

from __future__ import annotations

import math

import numpy as np

from onnxgen.convert.synthetic.blocks import Builder, rope_caches


def build_plain(b: Builder) -> None:
    """Append the whole "plain" or "onnx23" graph (as `b.cfg.attention` says) to `b.g`."""
    cfg, g = b.cfg, b.g
    onnx23 = cfg.attention == "onnx23"
    bias = _mask_bias(b)
    cosc, sinc = rope_caches(cfg, full=not onnx23)
    g.init("cos_cache", cosc.shape, lambda: cosc)
    g.init("sin_cache", sinc.shape, lambda: sinc)
    if not onnx23:
        rb = "/model/rotary_emb"
        cos = g.node(
            "Unsqueeze",
            [g.node("Gather", ["cos_cache", "position_ids"], f"{rb}/Gather_cos"), g.const([1], "INT64")],
            f"{rb}/Unsqueeze_cos",
        )
        sin = g.node(
            "Unsqueeze",
            [g.node("Gather", ["sin_cache", "position_ids"], f"{rb}/Gather_sin"), g.const([1], "INT64")],
            f"{rb}/Unsqueeze_sin",
        )
        bias5 = g.node(
            "Unsqueeze", [bias, g.const([1], "INT64")], "/model/attn_mask/Unsqueeze_5d"
        )  # [B,1,1,S,T]
    x = b.embedding()
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        lb = f"/model/layers.{i}"
        normed = _rms(b, x, p + "input_layernorm.weight", f"{lb}/input_layernorm")
        q = _attn_proj(b, i, "q", normed, cfg.q_size)
        k = _attn_proj(b, i, "k", normed, cfg.kv_size)
        v = _attn_proj(b, i, "v", normed, cfg.kv_size)
        if onnx23:
            attn = _attention_onnx23(b, i, q, k, v, bias)
        else:
            attn = _attention_plain(b, i, q, k, v, cos, sin, bias5)
        x = g.node("Add", [x, _attn_proj(b, i, "o", attn, cfg.hidden_size)], f"{lb}/Add_attn")
        normed = _rms(b, x, p + "post_attention_layernorm.weight", f"{lb}/post_attention_layernorm")
        x = g.node("Add", [x, b.mlp(i, normed)], f"{lb}/Add_mlp")
    b.lm_head(_rms(b, x, "model.norm.weight", "/model/norm"))


def _attn_proj(b: Builder, i: int, name: str, x: str, out_features: int) -> str:
    """Layer `i`'s `self_attn.{name}_proj` (q, k, v or o) applied to `x`; returns its output."""
    w = f"model.layers.{i}.self_attn.{name}_proj."
    return b.linear(
        f"/model/layers.{i}/self_attn/{name}_proj", x, [w + "weight"], w + "MatMul.weight", out_features
    )


def _attention_onnx23(b: Builder, i: int, q: str, k: str, v: str, bias: str) -> str:
    """Layer `i`'s RotaryEmbedding on q/k and opset-23 Attention over past + new KV; returns [B, S, H*D]."""
    cfg, g = b.cfg, b.g
    h, kvh = cfg.num_heads, cfg.num_kv_heads
    a = f"/model/layers.{i}/self_attn"
    q = g.node(
        "RotaryEmbedding",
        [q, "cos_cache", "sin_cache", "position_ids"],
        f"{a}/q_rotary",
        num_heads=h,
        interleaved=0,
    )
    k = g.node(
        "RotaryEmbedding",
        [k, "cos_cache", "sin_cache", "position_ids"],
        f"{a}/k_rotary",
        num_heads=kvh,
        interleaved=0,
    )
    return g.node(
        "Attention",
        [q, k, v, bias, f"past_key_values.{i}.key", f"past_key_values.{i}.value"],
        f"{a}/Attention",
        outputs=[f"{a}/Attention/output_0", f"present.{i}.key", f"present.{i}.value"],
        q_num_heads=h,
        kv_num_heads=kvh,
        scale=1.0 / math.sqrt(cfg.head_dim),
        is_causal=0,
    )[0]


def _attention_plain(b: Builder, i: int, q: str, k: str, v: str, cos: str, sin: str, bias5: str) -> str:
    """Layer `i`'s attention in opset-22 ops: rope, Concat(past, new) as `present.{i}.*`, then
    softmax(q k^T * scale + mask) v with query heads grouped per KV head [B, KV, G, S, D] (softmax in
    float32). Returns [B, S, H*D]."""
    cfg, g = b.cfg, b.g
    h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    a = f"/model/layers.{i}/self_attn"
    qh = _rope(b, _heads(b, q, h, f"{a}/q"), cos, sin, f"{a}/rotary_q")
    kh = _rope(b, _heads(b, k, kvh, f"{a}/k"), cos, sin, f"{a}/rotary_k")
    vh = _heads(b, v, kvh, f"{a}/v")
    pk = g.node(
        "Concat", [f"past_key_values.{i}.key", kh], f"{a}/Concat_k", outputs=[f"present.{i}.key"], axis=2
    )
    pv = g.node(
        "Concat", [f"past_key_values.{i}.value", vh], f"{a}/Concat_v", outputs=[f"present.{i}.value"], axis=2
    )
    q5 = g.node("Reshape", [qh, g.const([0, kvh, h // kvh, -1, d], "INT64")], f"{a}/Reshape_q5")
    k5 = g.node("Unsqueeze", [pk, g.const([2], "INT64")], f"{a}/Unsqueeze_k5")
    v5 = g.node("Unsqueeze", [pv, g.const([2], "INT64")], f"{a}/Unsqueeze_v5")
    kt = g.node("Transpose", [k5], f"{a}/Transpose_kt", perm=[0, 1, 2, 4, 3])
    sc = g.node("MatMul", [q5, kt], f"{a}/MatMul_qk")
    sc = g.node("Mul", [sc, g.const(1.0 / math.sqrt(d), "T")], f"{a}/Mul_scale")
    sc = g.node("Add", [sc, bias5], f"{a}/Add_mask")
    if cfg.dtype != "float32":
        sc = g.node("Cast", [sc], f"{a}/Cast_scores", to=1)
    pr = g.node("Softmax", [sc], f"{a}/Softmax", axis=-1)
    if cfg.dtype != "float32":
        pr = g.node("Cast", [pr], f"{a}/Cast_probs", to=g.elem)
    o5 = g.node("MatMul", [pr, v5], f"{a}/MatMul_pv")  # [B, KV, G, S, D]
    o4 = g.node("Reshape", [o5, g.const([0, h, -1, d], "INT64")], f"{a}/Reshape_o4")
    ot = g.node("Transpose", [o4], f"{a}/Transpose_o", perm=[0, 2, 1, 3])
    return g.node("Reshape", [ot, g.const([0, 0, h * d], "INT64")], f"{a}/Reshape_o")


def _mask_bias(b: Builder) -> str:
    """Additive mask [B, 1, S, T] in the model dtype: 0 where key j is visible to query i
    (j <= past + i and attention_mask[b, j] == 1), else the dtype's most negative value."""
    g = b.g
    mb = "/model/attn_mask"
    t = g.node("Shape", ["attention_mask"], f"{mb}/Shape_T", start=1, end=2)
    s = g.node("Shape", ["input_ids"], f"{mb}/Shape_S", start=1, end=2)
    t0 = g.node("Squeeze", [t, g.const([0], "INT64")], f"{mb}/Squeeze_T")
    s0 = g.node("Squeeze", [s, g.const([0], "INT64")], f"{mb}/Squeeze_S")
    past = g.node("Sub", [t0, s0], f"{mb}/Sub")
    kidx = g.node("Range", [g.const(0, "INT64"), t0, g.const(1, "INT64")], f"{mb}/Range_K")
    qidx = g.node("Range", [past, t0, g.const(1, "INT64")], f"{mb}/Range_Q")
    qcol = g.node("Unsqueeze", [qidx, g.const([1], "INT64")], f"{mb}/Unsqueeze_Q")
    causal = g.node("LessOrEqual", [kidx, qcol], f"{mb}/LessOrEqual")  # [S, T]
    pad = g.node("Cast", ["attention_mask"], f"{mb}/Cast", to=9)
    pad4 = g.node("Unsqueeze", [pad, g.const([1, 2], "INT64")], f"{mb}/Unsqueeze_M")  # [B, 1, 1, T]
    allowed = g.node("And", [causal, pad4], f"{mb}/And")  # [B, 1, S, T]
    neg = {
        "float32": float(np.finfo(np.float32).min),
        "float16": float(np.finfo(np.float16).min),
        "bfloat16": -3.3895313892515355e38,  # most negative finite bfloat16
    }[b.cfg.dtype]
    return g.node("Where", [allowed, g.const(0.0, "T"), g.const(neg, "T")], f"{mb}/Where")


def _rms(b: Builder, x: str, hf: str, base: str) -> str:
    """RMSNorm of `x` with weight `hf` (registered under the same name): RMSNormalization for
    "onnx23", else Pow/ReduceMean/Sqrt/Div computed in float32."""
    cfg, g = b.cfg, b.g
    w = b.norm_weight(hf, hf)
    if cfg.attention == "onnx23":
        return g.node(
            "RMSNormalization",
            [x, w],
            f"{base}/RMSNormalization",
            axis=-1,
            epsilon=cfg.rms_norm_eps,
            stash_type=1,
        )
    xf = x if cfg.dtype == "float32" else g.node("Cast", [x], f"{base}/Cast", to=1)
    sq = g.node("Pow", [xf, g.const(2.0, "FLOAT")], f"{base}/Pow")
    mean = g.node("ReduceMean", [sq, g.const([-1], "INT64")], f"{base}/ReduceMean", keepdims=1)
    add = g.node("Add", [mean, g.const(cfg.rms_norm_eps, "FLOAT")], f"{base}/Add")
    root = g.node("Sqrt", [add], f"{base}/Sqrt")
    y = g.node("Div", [xf, root], f"{base}/Div")
    if cfg.dtype != "float32":
        y = g.node("Cast", [y], f"{base}/Cast_1", to=g.elem)
    return g.node("Mul", [w, y], f"{base}/Mul")


def _heads(b: Builder, x: str, n: int, base: str) -> str:
    """[B, S, n*D] -> [B, n, S, D]."""
    g = b.g
    r = g.node("Reshape", [x, g.const([0, 0, n, b.cfg.head_dim], "INT64")], f"{base}/Reshape")
    return g.node("Transpose", [r], f"{base}/Transpose", perm=[0, 2, 1, 3])


def _rope(b: Builder, x: str, cos: str, sin: str, base: str) -> str:
    """x [B, N, S, D] * cos + rotate_half(x) * sin, cos/sin [B, 1, S, D]."""
    g = b.g
    half = b.cfg.head_dim // 2
    x1 = g.node(
        "Slice",
        [x, g.const([0], "INT64"), g.const([half], "INT64"), g.const([-1], "INT64")],
        f"{base}/Slice_1",
    )
    x2 = g.node(
        "Slice",
        [x, g.const([half], "INT64"), g.const([2 * half], "INT64"), g.const([-1], "INT64")],
        f"{base}/Slice_2",
    )
    rot = g.node("Concat", [g.node("Neg", [x2], f"{base}/Neg"), x1], f"{base}/Concat", axis=-1)
    c = g.node("Mul", [x, cos], f"{base}/Mul_cos")
    s = g.node("Mul", [rot, sin], f"{base}/Mul_sin")
    return g.node("Add", [c, s], f"{base}/Add")
