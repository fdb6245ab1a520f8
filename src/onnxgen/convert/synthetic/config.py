"""`SyntheticConfig` (shape, dtype, graph style of a synthetic Llama package), its presets, and what
follows from it: the Hugging Face weight names and shapes, and the matching transformers config."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from onnxgen.errors import ConversionError

DTYPES = ("float32", "float16", "bfloat16")
ATTENTION_STYLES = ("gqa", "plain", "onnx23")


@dataclass(frozen=True)
class SyntheticConfig:
    """Shape, dtype and graph style of a synthetic Llama package. Immutable; validated at creation.

    `attention` picks the graph style (see the package docstring); `quant="int4"` makes every linear
    layer MatMulNBits and `quant_embeddings` the embedding GatherBlockQuantized. `local_window_size`
    and `softcap` are GroupQueryAttention attributes (gqa only); `extra_inputs` are float inputs
    `[batch, 3, 8, 8]` the graph consumes (so onnxruntime demands them); `chunk_size` and
    `eos_token_ids` go to genai_config.json (`eos_token_ids` replaces the tokenizer's).

    Raises ConversionError for inconsistent values (e.g. heads not a multiple of kv heads).
    """

    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int | None = None
    intermediate_size: int = 128
    vocab_size: int = 384
    context_length: int = 2048
    dtype: str = "float32"
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention: str = "gqa"
    quant: str | None = None
    quant_zero_points: bool = False
    accuracy_level: int = 0
    quant_embeddings: bool = False
    local_window_size: int = -1
    softcap: float = 0.0
    extra_inputs: tuple[str, ...] = ()
    chunk_size: int | None = None
    model_type: str = "llama"
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        def bad(msg: str) -> ConversionError:
            return ConversionError(f"SyntheticConfig: {msg}")

        for key in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "vocab_size",
            "context_length",
        ):
            if getattr(self, key) < 1:
                raise bad(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.num_heads % self.num_kv_heads:
            raise bad(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise bad(f"head_size must be even for rotary embeddings, got {self.head_dim}")
        if self.dtype not in DTYPES:
            raise bad(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.attention not in ATTENTION_STYLES:
            raise bad(f"attention must be one of {ATTENTION_STYLES}, got {self.attention!r}")
        if self.quant not in (None, "int4"):
            raise bad(f"quant must be None or 'int4', got {self.quant!r}")
        if self.quant_embeddings and self.quant is None:
            raise bad("quant_embeddings=True needs quant='int4'")
        if self.attention != "gqa" and (self.local_window_size != -1 or self.softcap != 0.0):
            raise bad("local_window_size and softcap are GroupQueryAttention attributes: use attention='gqa'")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise bad(f"chunk_size must be >= 1, got {self.chunk_size}")
        if not 0 <= self.accuracy_level <= 4:
            raise bad(f"accuracy_level must be in 0..4, got {self.accuracy_level}")

    @property
    def head_dim(self) -> int:
        return self.head_size if self.head_size is not None else self.hidden_size // self.num_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        """Parameters as transformers counts them (tied embeddings counted once)."""
        return sum(math.prod(s) for s in hf_weight_shapes(self).values())


LLAMA_1B = SyntheticConfig(
    num_layers=16,
    hidden_size=2048,
    num_heads=32,
    num_kv_heads=8,
    head_size=64,
    intermediate_size=8192,
    vocab_size=128256,
    context_length=16384,
    dtype="bfloat16",
    rope_theta=500000.0,
    tie_embeddings=True,
)
"""Llama-3.2-1B's shape (1,235,814,400 parameters); plain RoPE (no llama3 rope scaling)."""

LLAMA_8B = SyntheticConfig(
    num_layers=32,
    hidden_size=4096,
    num_heads=32,
    num_kv_heads=8,
    head_size=128,
    intermediate_size=14336,
    vocab_size=128256,
    context_length=8192,
    dtype="bfloat16",
    rope_theta=500000.0,
    tie_embeddings=False,
)
"""Llama-3-8B's shape (8,030,261,248 parameters)."""


def hf_weight_shapes(cfg: SyntheticConfig) -> dict[str, tuple[int, ...]]:
    """HF Llama parameter names -> shapes ([out, in] Linear layout), in a fixed order (the seeding
    order of random weights).

    `lm_head.weight` is absent when embeddings are tied (transformers ties it to embed_tokens).
    """
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def to_hf_llama_config(cfg: SyntheticConfig) -> dict[str, Any]:
    """transformers `LlamaConfig` kwargs for the same model: `LlamaForCausalLM(LlamaConfig(**kw))`
    takes `random_weights(cfg)` via `load_state_dict` (plain RoPE, no rope scaling)."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.context_length,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
