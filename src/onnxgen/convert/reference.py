"""Reference packages from an independent producer: random Llama (and Gemma 3) checkpoints saved by
transformers, converted by onnxruntime-genai's model builder.

The project's own synthetic writer (`onnxgen.convert.synthetic`) is not independent of the code under
test; these packages are. Parity tests and GPU benchmarks compare the native backend on such a
package against transformers running the same checkpoint (fp32 as the reference, bf16 as the
yardstick for what bf16 arithmetic alone costs).

    hf = random_llama_checkpoint(tmp / "hf", LlamaShape(hidden_size=2048, num_layers=4), tokenizer_dir)
    pkg = convert_checkpoint(hf, tmp / "pkg", precision="bf16", execution_provider="cuda")
    hf = random_checkpoint(tmp / "g3", SHAPES["gemma3_1b"], tokenizer_dir)   # either kind of shape

Needs the `convert` extra (torch, transformers, onnxruntime-genai). Nothing is downloaded: the
tokenizer files are copied from `tokenizer_dir` (e.g. the default model's package).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


@dataclass(frozen=True)
class LlamaShape:
    """The shape of a random Llama checkpoint. Defaults: Llama-3.2-1B's layer shape with SmolLM2's
    vocabulary (49152) so SmolLM2's tokenizer fits."""

    hidden_size: int = 2048
    num_layers: int = 16
    num_heads: int = 32
    num_kv_heads: int = 8
    intermediate_size: int = 8192
    vocab_size: int = 49152
    context_length: int = 8192
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"heads must divide: hidden {self.hidden_size}, heads {self.num_heads}/{self.num_kv_heads}"
            )


@dataclass(frozen=True)
class Gemma3Shape:
    """The shape of a random Gemma 3 text checkpoint (`Gemma3ForCausalLM`): sliding-window layers with their own
    RoPE base, every `global_every`-th layer global, q/k norms, `query_pre_attn_scalar` for the scale. Defaults:
    Gemma-3-1B's shape (its 262k vocabulary; SmolLM2's tokenizer files still serve: its ids are a subset)."""

    hidden_size: int = 1152
    num_layers: int = 26
    num_heads: int = 4
    num_kv_heads: int = 1
    head_dim: int = 256
    intermediate_size: int = 6912
    vocab_size: int = 262144
    context_length: int = 32768
    sliding_window: int = 512
    global_every: int = 6
    rope_theta: float = 1_000_000.0
    rope_local_theta: float = 10_000.0
    query_pre_attn_scalar: int = 256
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads or self.sliding_window < 1 or self.global_every < 1:
            raise ValueError(f"bad Gemma 3 shape: {self}")

    @property
    def layer_types(self) -> list[str]:
        return [
            "full_attention" if (i + 1) % self.global_every == 0 else "sliding_attention"
            for i in range(self.num_layers)
        ]


SHAPES: dict[str, LlamaShape | Gemma3Shape] = {
    "tiny": LlamaShape(
        hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=2, intermediate_size=512, context_length=1024
    ),  # dry runs
    "2048x4": LlamaShape(num_layers=4),  # reproduces the 1B shape's numerics in seconds on a CPU
    "135m": LlamaShape(
        hidden_size=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
    ),  # SmolLM2-135M's shape (the default model's): CPU comparisons where its GGUF is not at hand
    "0.5b": LlamaShape(
        hidden_size=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        rope_theta=1000000.0,
    ),  # Qwen2.5-0.5B's shape (no qkv bias)
    "1b": LlamaShape(),
    "8b": LlamaShape(hidden_size=4096, num_layers=32, intermediate_size=14336, tie_word_embeddings=False),
    # the same with a 16k context: conversations that grow past 8k tokens
    "8b16k": LlamaShape(
        hidden_size=4096,
        num_layers=32,
        intermediate_size=14336,
        tie_word_embeddings=False,
        context_length=16384,
    ),
    # Gemma-3-1B's shape: 26 layers, 5 sliding (window 512) to 1 global, head_dim 256, one KV head
    "gemma3_1b": Gemma3Shape(),
    # its layer shape, 6 layers (5 sliding + 1 global): its numerics on a CPU in minutes
    "gemma3_6l": Gemma3Shape(num_layers=6),
    # a small one: windows of 64, SmolLM2's vocabulary (CPU tests of the whole chain in seconds)
    "gemma3_tiny": Gemma3Shape(
        hidden_size=256,
        num_layers=6,
        num_heads=4,
        num_kv_heads=1,
        head_dim=64,
        intermediate_size=512,
        vocab_size=49152,
        context_length=4096,
        sliding_window=64,
        global_every=3,
    ),
}


def random_checkpoint(
    dest: Path,
    shape: LlamaShape | Gemma3Shape,
    tokenizer_dir: Path,
    *,
    seed: int = 0,
    device: str = "cpu",
    dtype: str = "bfloat16",
) -> Path:
    """`random_llama_checkpoint` or `random_gemma3_checkpoint`, by the kind of `shape`."""
    make = random_gemma3_checkpoint if isinstance(shape, Gemma3Shape) else random_llama_checkpoint
    return make(dest, shape, tokenizer_dir, seed=seed, device=device, dtype=dtype)  # type: ignore[arg-type]


def random_gemma3_checkpoint(
    dest: Path,
    shape: Gemma3Shape,
    tokenizer_dir: Path,
    *,
    seed: int = 0,
    device: str = "cpu",
    dtype: str = "bfloat16",
) -> Path:
    """As `random_llama_checkpoint`, for a Gemma 3 text model (`Gemma3TextConfig`, transformers' RoPE per layer
    type: the builder gets it normalized by `onnxgen.convert.builder_config`)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    dest = Path(dest)
    cfg = Gemma3TextConfig(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab_size,
        max_position_embeddings=shape.context_length,
        sliding_window=shape.sliding_window,
        layer_types=shape.layer_types,
        query_pre_attn_scalar=shape.query_pre_attn_scalar,
        rms_norm_eps=shape.rms_norm_eps,
        tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict) and set(rp) >= {"full_attention", "sliding_attention"}:  # transformers 5
        rp["full_attention"]["rope_theta"] = shape.rope_theta
        rp["sliding_attention"]["rope_theta"] = shape.rope_local_theta
    else:  # transformers 4.x
        cfg.rope_theta, cfg.rope_local_base_freq = shape.rope_theta, shape.rope_local_theta
    torch.manual_seed(seed)
    with torch.device(device):
        model = Gemma3ForCausalLM(cfg)
    model.to(getattr(torch, dtype)).save_pretrained(dest)
    del model
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, dest / name)
    return dest


def random_llama_checkpoint(
    dest: Path,
    shape: LlamaShape,
    tokenizer_dir: Path,
    *,
    seed: int = 0,
    device: str = "cpu",
    dtype: str = "bfloat16",
) -> Path:
    """Write a Hugging Face folder with transformers' default random init of `shape` into `dest`.

    Weights are saved in `dtype` (bfloat16 by default, so a bf16 package and an fp32 reference loaded
    from the folder hold exactly the same values). `device="cuda"` initialises on the GPU (fast for 8B
    shapes). Returns `dest`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dest = Path(dest)
    cfg = LlamaConfig(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        vocab_size=shape.vocab_size,
        max_position_embeddings=shape.context_length,
        rope_theta=shape.rope_theta,
        rms_norm_eps=shape.rms_norm_eps,
        tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
    )
    # transformers 5 keeps the base in `rope_parameters`; 4.x in `rope_theta`. Set it where it is read.
    if isinstance(getattr(cfg, "rope_parameters", None), dict):
        cfg.rope_parameters["rope_theta"] = shape.rope_theta
    else:
        cfg.rope_theta = shape.rope_theta
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model.to(getattr(torch, dtype)).save_pretrained(dest)
    del model
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, dest / name)
    return dest
