"""The "gqa" graph style: onnxruntime-genai's model builder op set.

Per layer: `SimplifiedLayerNormalization` (first layer) or the previous layer's
`SkipSimplifiedLayerNormalization`, one fused qkv projection, com.microsoft `GroupQueryAttention`
(do_rotary=1, packed qkv query, cos/sin caches `[context, head/2]`, KV shared through
`past_key_values.%d.*` / `present.%d.*`), o_proj, `SkipSimplifiedLayerNormalization`, the MLP.
`seqlens_k` / `total_sequence_length` come from the builder's attention-mask subgraph
(ReduceSum-1, Shape[1], Cast int32).
"""

from __future__ import annotations

import math

from onnxgen.convert.synthetic.blocks import Builder, rope_caches


def build_gqa(b: Builder) -> None:
    """Append the whole gqa-style graph (embedding to logits) to `b.g`."""
    cfg, g = b.cfg, b.g
    # attention mask -> seqlens_k (int32 [B]) and total_sequence_length (int32 scalar), as the builder.
    mb = "/model/attn_mask_reformat/attn_mask_subgraph"
    one_vec = g.const([1], "INT64")
    rsum = g.node("ReduceSum", ["attention_mask", one_vec], f"{mb}/ReduceSum", keepdims=0)
    sub = g.node("Sub", [rsum, one_vec], f"{mb}/Sub")
    seqlens_k = g.node("Cast", [sub], f"{mb}/Sub/Cast", to=6)
    shape = g.node("Shape", ["attention_mask"], f"{mb}/Shape")
    tot = g.node("Gather", [shape, g.const(1, "INT64")], f"{mb}/Gather", axis=0)
    total_len = g.node("Cast", [tot], f"{mb}/Gather/Cast", to=6)

    x = b.embedding()
    cos, sin = rope_caches(cfg, full=False)
    residual = x
    normed = None
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        lb = f"/model/layers.{i}"
        if i == 0:
            w = b.norm_weight(p + "input_layernorm.weight", p + "input_layernorm.weight")
            normed = g.node(
                "SimplifiedLayerNormalization",
                [x, w],
                f"{lb}/input_layernorm/LayerNorm",
                outputs=[f"{lb}/input_layernorm/output_0"],
                epsilon=cfg.rms_norm_eps,
                axis=-1,
                stash_type=1,
            )
        assert normed is not None
        qkv = b.linear(
            f"{lb}/attn/qkv_proj",
            normed,
            [p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"],
            f"{p}attn.qkv_proj.MatMul.weight",
            cfg.q_size + 2 * cfg.kv_size,
        )
        if i == 0:
            g.init("cos_cache", cos.shape, lambda: cos)
            g.init("sin_cache", sin.shape, lambda: sin)
        attn = g.node(
            "GroupQueryAttention",
            [
                qkv,
                "",
                "",
                f"past_key_values.{i}.key",
                f"past_key_values.{i}.value",
                seqlens_k,
                total_len,
                "cos_cache",
                "sin_cache",
                "",
                "",
                "",
            ],
            f"{lb}/attn/GroupQueryAttention",
            domain="com.microsoft",
            outputs=[f"{lb}/attn/GroupQueryAttention/output_0", f"present.{i}.key", f"present.{i}.value"],
            num_heads=cfg.num_heads,
            kv_num_heads=cfg.num_kv_heads,
            scale=1.0 / math.sqrt(cfg.head_dim),
            local_window_size=cfg.local_window_size,
            softcap=float(cfg.softcap),
            do_rotary=1,
            rotary_interleaved=0,
        )[0]
        o = b.linear(
            f"{lb}/attn/o_proj",
            attn,
            [p + "self_attn.o_proj.weight"],
            f"{p}attn.o_proj.MatMul.weight",
            cfg.hidden_size,
        )
        w = b.norm_weight(p + "post_attention_layernorm.weight", p + "post_attention_layernorm.weight")
        pb = f"{lb}/post_attention_layernorm"
        g.node(
            "SkipSimplifiedLayerNormalization",
            [residual, o, w],
            f"{pb}/SkipLayerNorm",
            domain="com.microsoft",
            outputs=[f"{pb}/output_0", "", "", f"{pb}/output_3"],
            epsilon=cfg.rms_norm_eps,
        )
        normed, residual = f"{pb}/output_0", f"{pb}/output_3"
        down = b.mlp(i, normed)
        if i + 1 < cfg.num_layers:
            nb = f"/model/layers.{i + 1}/input_layernorm"
            hf = f"model.layers.{i + 1}.input_layernorm.weight"
            w = b.norm_weight(hf, hf)
            g.node(
                "SkipSimplifiedLayerNormalization",
                [residual, down, w],
                f"{nb}/SkipLayerNorm",
                domain="com.microsoft",
                outputs=[f"{nb}/output_0", "", "", f"{nb}/output_3"],
                epsilon=cfg.rms_norm_eps,
            )
            normed, residual = f"{nb}/output_0", f"{nb}/output_3"
    fb = f"/model/layers.{cfg.num_layers}/final_norm_layernorm"
    w = b.norm_weight(f"model.layers.{cfg.num_layers}.final_norm_layernorm.weight", "model.norm.weight")
    g.node(
        "SkipSimplifiedLayerNormalization",
        [residual, down, w],
        f"{fb}/SkipLayerNorm",
        domain="com.microsoft",
        outputs=[f"{fb}/output_0"],
        epsilon=cfg.rms_norm_eps,
    )
    b.lm_head(f"{fb}/output_0")
