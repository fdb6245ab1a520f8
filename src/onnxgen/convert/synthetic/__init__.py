"""Write synthetic ONNX Runtime GenAI packages: any Llama shape and dtype, random or given weights.

A package is `genai_config.json` + `model.onnx` + `model.onnx.data` (every weight as external data)
+ `tokenizer.json` + `tokenizer_config.json` + `chat_template.jinja`, laid out exactly as
onnxruntime-genai's model builder lays them out, so fixtures exercise the same code paths as real
packages. Three graph styles (`SyntheticConfig.attention`):

- ``"gqa"``: the builder's op set. Inputs `input_ids`, `attention_mask`, `past_key_values.%d.key/value`
  `[batch, kv_heads, past_seq, kv_cache_dim]`; com.microsoft `GroupQueryAttention` (do_rotary=1,
  packed fused-qkv query, cos/sin caches `[context, head/2]`), `seqlens_k` / `total_sequence_length`
  from the builder's attention-mask subgraph (ReduceSum-1, Shape[1], Cast int32),
  `SimplifiedLayerNormalization` then `SkipSimplifiedLayerNormalization`, SiLU as Sigmoid*Mul,
  tied embeddings as Transpose+Gather of `lm_head.MatMul.weight`, bf16 logits cast to float32.
- ``"plain"``: only ai.onnx (opset 22) ops, like an optimum export: adds `position_ids`, RoPE by
  Gather of full-width cos/sin caches, Concat(past, new) -> `present.%d.key/value`, a causal+padding
  additive mask from `attention_mask`, MatMul/Softmax attention, RMSNorm from Pow/ReduceMean/Sqrt/Div.
- ``"onnx23"``: opset-23 `Attention`, `RotaryEmbedding` and `RMSNormalization` (ai.onnx), KV as "plain".

`quant="int4"` turns every linear layer (lm_head included) into com.microsoft `MatMulNBits`
(bits=4, block_size=32, B `[N, K/32, 16]` uint8 with the low nibble first, scales `[N*K/32]` in the
model dtype, optional packed uint8 zero points `[N*ceil(K/32/2)]`, default zero point 8);
`quant_embeddings=True` gathers the embedding with `GatherBlockQuantized` (same packing, uint8 data
`[V, H/2]`, scales `[V, H/32]`).

onnxruntime (CPU) coverage, checked with onnxruntime 1.32:
- float32: every style, with and without int4.
- float16: every style runs on CPU (int4 included).
- bfloat16: ORT's CPU provider has no bf16 MatMul/GroupQueryAttention kernels, so bf16 packages
  only run on CUDA (ORT CUDA EP) or with onnxgen's native backend.

The modules, in dependency order: `config` (SyntheticConfig, presets, HF names and shapes), `arrays`
(numpy-or-torch helpers, dtypes), `quant` (int4 blocks), `weights` (random, given, reference),
`graph` (the ONNX graph under construction), `blocks` (parts shared by the styles), `gqa` and `plain`
(the styles), `tokenizer`, `external_data` (streaming model.onnx.data), `package` (write_package),
`__main__` (`python -m onnxgen.convert.synthetic`).

Nothing here is imported by the runtime; torch / onnx / tokenizers are imported lazily.
"""

from onnxgen.convert.synthetic.config import (
    LLAMA_1B,
    LLAMA_8B,
    SyntheticConfig,
    hf_weight_shapes,
    to_hf_llama_config,
)
from onnxgen.convert.synthetic.package import write_package
from onnxgen.convert.synthetic.quant import BLOCK_SIZE, dequantize_int4, quantize_int4
from onnxgen.convert.synthetic.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS
from onnxgen.convert.synthetic.weights import random_weights, reference_weights

__all__ = [
    "BLOCK_SIZE",
    "CHAT_TEMPLATE",
    "LLAMA_1B",
    "LLAMA_8B",
    "SPECIAL_TOKENS",
    "SyntheticConfig",
    "dequantize_int4",
    "hf_weight_shapes",
    "quantize_int4",
    "random_weights",
    "reference_weights",
    "to_hf_llama_config",
    "write_package",
]
