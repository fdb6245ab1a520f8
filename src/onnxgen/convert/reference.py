"""Reference packages from an independent producer: random Llama (and Phi-3 LongRoPE, Gemma 3, and gpt-oss
mixture-of-experts) checkpoints saved by transformers, converted by onnxruntime-genai's model builder.

The project's own synthetic writer (`onnxgen.convert.synthetic`) is not independent of the code under
test; these packages are. Parity tests and GPU benchmarks compare the native backend on such a
package against transformers running the same checkpoint (fp32 as the reference, bf16 as the
yardstick for what bf16 arithmetic alone costs).

    hf = random_llama_checkpoint(tmp / "hf", LlamaShape(hidden_size=2048, num_layers=4), tokenizer_dir)
    pkg = convert_checkpoint(hf, tmp / "pkg", precision="bf16", execution_provider="cuda")
    hf = random_checkpoint(tmp / "moe", SHAPES["gptoss-20bx2"], tokenizer_dir)   # any shape's kind

Needs the `convert` extra (torch, transformers, onnxruntime-genai). Nothing is downloaded: the
tokenizer files are copied from `tokenizer_dir` (e.g. the default model's package).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


@dataclass(frozen=True)
class LlamaShape:
    """The shape of a random Llama checkpoint. Defaults: Llama-3.2-1B's layer shape with SmolLM2's
    vocabulary (49152) so SmolLM2's tokenizer fits.

    `architecture` "phi3": a Phi-3 checkpoint instead (fused qkv and gate/up projections), with LongRoPE when
    `original_context` is set (the length past which the long factors apply, `original_max_position_
    embeddings`; `context_length` is then `max_position_embeddings`) and `partial_rotary_factor` (Phi-4-mini:
    0.75 of each head rotated). The LongRoPE factors are made up (`longrope_factors`): smooth, short ones near
    1, long ones growing to 40 over the frequencies, as Phi-3.5 / Phi-4-mini's are shaped."""

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
    architecture: str = "llama"
    partial_rotary_factor: float = 1.0
    original_context: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"heads must divide: hidden {self.hidden_size}, heads {self.num_heads}/{self.num_kv_heads}"
            )
        if self.architecture not in ("llama", "phi3"):
            raise ValueError(f"architecture must be 'llama' or 'phi3', got {self.architecture!r}")
        if (self.original_context or self.partial_rotary_factor != 1.0) and self.architecture != "phi3":
            raise ValueError("LongRoPE and partial rotary shapes are Phi-3 ones (architecture='phi3')")

    @property
    def rotary_dim(self) -> int:
        return int(self.hidden_size // self.num_heads * self.partial_rotary_factor)


def longrope_factors(rotary_dim: int) -> tuple[list[float], list[float]]:
    """Made-up LongRoPE (short, long) factors for `rotary_dim / 2` frequencies (see `LlamaShape`)."""
    n = rotary_dim // 2
    short = [1.0 + 0.05 * (i / max(n - 1, 1)) ** 2 for i in range(n)]
    long = [1.0 + 39.0 * (i / max(n - 1, 1)) ** 2 for i in range(n)]
    return short, long


@dataclass(frozen=True)
class GptOssShape:
    """The shape of a random gpt-oss checkpoint (a mixture of experts: 1.702 / 1 / 7 SwiGLU experts with
    biases, top-k routing, attention sinks, a sliding window on every other layer, YaRN). Defaults:
    gpt-oss-20b's (24 layers, hidden 2880, 64 query / 8 KV heads of 64, 32 experts of 2880, top 4, window 128,
    vocabulary 201088): ~21 B parameters (~42 GB in bf16), ~3.6 B of them read per token (4 of 32 experts)."""

    hidden_size: int = 2880
    num_layers: int = 24
    num_heads: int = 64
    num_kv_heads: int = 8
    head_dim: int = 64
    intermediate_size: int = 2880
    num_experts: int = 32
    experts_per_token: int = 4
    sliding_window: int = 128
    vocab_size: int = 201088
    context_length: int = 131072
    rope_theta: float = 150000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads or self.experts_per_token > self.num_experts:
            raise ValueError(f"bad gpt-oss shape: {self}")


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


SHAPES: dict[str, LlamaShape | Gemma3Shape | GptOssShape] = {
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
    "gptoss-tiny": GptOssShape(
        hidden_size=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=256,
        num_experts=8,
        experts_per_token=2,
        sliding_window=32,
        vocab_size=49152,
        context_length=4096,
    ),  # dry runs
    "gptoss-20b": GptOssShape(),  # ~42 GB checkpoint + ~42 GB package: hosts with the disk for both
    "gptoss-20bx8": GptOssShape(num_layers=8),  # the 20B layer in 8 layers (~14 GB each): a 64 GiB disk
    "gptoss-20bx2": GptOssShape(num_layers=2),  # the same in 2 layers: parity against transformers fp32
    # Phi-4-mini's shape (3.8B: 24/8 heads of 128, 3/4 of each rotated, LongRoPE switching at 4096 tokens, a
    # 200064-token vocabulary, tied embeddings), and the same in 4 layers (CPU checks, quick GPU parity)
    "phi4mini": LlamaShape(
        hidden_size=3072,
        num_layers=32,
        num_heads=24,
        num_kv_heads=8,
        intermediate_size=8192,
        vocab_size=200064,
        context_length=131072,
        rope_theta=10000.0,
        architecture="phi3",
        partial_rotary_factor=0.75,
        original_context=4096,
    ),
    "phi4minix4": LlamaShape(
        hidden_size=3072,
        num_layers=4,
        num_heads=24,
        num_kv_heads=8,
        intermediate_size=8192,
        vocab_size=200064,
        context_length=131072,
        rope_theta=10000.0,
        architecture="phi3",
        partial_rotary_factor=0.75,
        original_context=4096,
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


def _with_tokenizer(dest: Path, tokenizer_dir: Path) -> Path:
    """Copy the tokenizer files `tokenizer_dir` has beside a saved checkpoint in `dest`; returns `dest`."""
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, dest / name)
    return dest


def random_checkpoint(
    dest: Path,
    shape: LlamaShape | Gemma3Shape | GptOssShape,
    tokenizer_dir: Path,
    *,
    seed: int = 0,
    device: str = "cpu",
    dtype: str = "bfloat16",
) -> Path:
    """`random_llama_checkpoint`, `random_gemma3_checkpoint` or `random_gptoss_checkpoint`, by the kind of
    `shape`."""
    make: Any = random_llama_checkpoint
    if isinstance(shape, Gemma3Shape):
        make = random_gemma3_checkpoint
    elif isinstance(shape, GptOssShape):
        make = random_gptoss_checkpoint
    return make(dest, shape, tokenizer_dir, seed=seed, device=device, dtype=dtype)  # type: ignore[arg-type]


def random_gptoss_checkpoint(
    dest: Path,
    shape: GptOssShape,
    tokenizer_dir: Path,
    *,
    seed: int = 0,
    device: str = "cpu",
    dtype: str = "bfloat16",
) -> Path:
    """Write a Hugging Face folder with transformers' random init of the gpt-oss `shape` into `dest`, made
    in `dtype` directly (a 20B shape never exists in float32: ~42 GB in bf16), on `device` (`"cuda"`: fast
    for the 20B shapes). transformers' init, but for the experts' biases (zero there: random here, so a
    dropped or misplaced bias shows). Returns `dest`."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    dest = Path(dest)
    cfg = GptOssConfig(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        num_local_experts=shape.num_experts,
        num_experts_per_tok=shape.experts_per_token,
        sliding_window=shape.sliding_window,
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(shape.num_layers)
        ],
        vocab_size=shape.vocab_size,
        max_position_embeddings=shape.context_length,
        rms_norm_eps=shape.rms_norm_eps,
        tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    if isinstance(getattr(cfg, "rope_parameters", None), dict):
        cfg.rope_parameters["rope_theta"] = shape.rope_theta
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            model = GptOssForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate_up_proj_bias", "down_proj_bias")):
                p.normal_(0.0, 0.02)
    model.save_pretrained(dest)
    del model
    return _with_tokenizer(dest, tokenizer_dir)


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
    return _with_tokenizer(dest, tokenizer_dir)


def random_llama_checkpoint(
    dest: Path,
    shape: LlamaShape,
    tokenizer_dir: Path,
    *,
    seed: int = 0,
    device: str = "cpu",
    dtype: str = "bfloat16",
) -> Path:
    """Write a Hugging Face folder with transformers' default random init of `shape` into `dest` (a Llama
    checkpoint, or a Phi-3 one for `architecture="phi3"`).

    Weights are saved in `dtype` (bfloat16 by default, so a bf16 package and an fp32 reference loaded
    from the folder hold exactly the same values). `device="cuda"` initialises on the GPU (fast for 8B
    shapes). Returns `dest`."""
    import torch
    import transformers

    dest = Path(dest)
    phi3 = shape.architecture == "phi3"
    common = {
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.context_length,
        "rope_theta": shape.rope_theta,
        "rms_norm_eps": shape.rms_norm_eps,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    rope: dict[str, object] = {"rope_type": "default", "rope_theta": shape.rope_theta}
    if phi3:
        # NOTE: the builder picks its LongRoPE class when the two lengths differ (`original_context` 0: equal)
        common["original_max_position_embeddings"] = shape.original_context or shape.context_length
        if shape.partial_rotary_factor != 1.0:
            rope["partial_rotary_factor"] = shape.partial_rotary_factor
        if shape.original_context:
            short, long = longrope_factors(shape.rotary_dim)
            rope.update(
                rope_type="longrope",
                original_max_position_embeddings=shape.original_context,
                short_factor=short,
                long_factor=long,
            )
            common["rope_parameters"] = rope
    cfg = (transformers.Phi3Config if phi3 else transformers.LlamaConfig)(**common)
    # transformers 5 keeps the base in `rope_parameters`; 4.x in `rope_theta`. Set it where it is read.
    if isinstance(getattr(cfg, "rope_parameters", None), dict):
        cfg.rope_parameters["rope_theta"] = shape.rope_theta
        if phi3 and shape.partial_rotary_factor != 1.0:
            cfg.rope_parameters["partial_rotary_factor"] = shape.partial_rotary_factor
    else:
        cfg.rope_theta = shape.rope_theta
    torch.manual_seed(seed)
    with torch.device(device):
        model = (transformers.Phi3ForCausalLM if phi3 else transformers.LlamaForCausalLM)(cfg)
    model.to(getattr(torch, dtype)).save_pretrained(dest)
    del model
    return _with_tokenizer(dest, tokenizer_dir)
