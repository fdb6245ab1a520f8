"""Tiny random checkpoints of every text architecture the model builder knows, and their packages.

Each `Recipe` is a transformers config (class and arguments) small enough to build in a second and known to
build (or known not to, with the builder's error), saved by transformers with seeded random weights and the
built-in byte-level tokenizer. The coverage matrix (`tests/parity/test_builder_matrix.py`) converts each and
compares both backends with transformers; anyone can use them to try a change on every architecture:

    builds = build_zoo(["llama", "gemma3"], Path("/tmp/zoo"))     # one subprocess for all of them
    builds["gemma3"].package                                      # /tmp/zoo/gemma3/pkg

What keeps a tiny config buildable (builder 0.18, onnxruntime 1.32):
- the vocabulary (520) equals no projection width: the builder takes any Linear whose `out_features` equals
  `vocab_size` for the lm_head (a 512-wide q_proj with a 512-token vocab silently became the lm_head);
- onnxruntime's GroupQueryAttention needs the rotary cache width (rotary dim / 2) <= head_dim / 2 and a
  multiple of 8: partial rotary (Phi-4-mini 0.75, Nemotron 0.5) needs head_dim >= 64 / 32;
- Phi-3 picks the LongRoPE class when `max_position_embeddings != original_max_position_embeddings`, so the
  short form sets both equal;
- sliding windows are 32 and LongRoPE switches at 64, so prompts of 12 and 100 tokens fall on both sides.

`python -m onnxgen.convert.zoo ROOT NAME...` builds in this process (what `build_zoo` runs): for each name
`ROOT/NAME/hf` (the checkpoint) and `ROOT/NAME/pkg` (the package, through `builder_config` and `builder_run`
as `onnxgen convert` does, without its subprocess per model), or the builder's error in `ROOT/NAME/error.txt`;
`ROOT/zoo.json` sums it up. Needs the `convert` extra.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnxgen.envs as envs

VOCAB = 520
WINDOW = 32
ROPE_SWITCH = 64
EOS = 2  # the byte-level tokenizer's <|im_end|>

_BASE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "bos_token_id": 1,
    "eos_token_id": EOS,
    "pad_token_id": EOS,
    "tie_word_embeddings": False,
}


def _longrope(rotary_dim: int, original: int = ROPE_SWITCH) -> dict[str, Any]:
    n = rotary_dim // 2
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "original_max_position_embeddings": original,
        "short_factor": [1.0 + 0.02 * i for i in range(n)],
        "long_factor": [1.5 + 0.1 * i for i in range(n)],
    }


@dataclass(frozen=True)
class Recipe:
    """One architecture's tiny checkpoint. `config` overrides the shared tiny shape (`_BASE`).

    windows: the sliding windows of its layers (empty: none). rope_switch: LongRoPE's threshold (None: no
    switch). mxfp4: the experts are rounded to MXFP4 and saved in gpt-oss's MXFP4 tensors too (what the
    builder's int4 path reads), the fp32 weights being those rounded values. builds: whether builder 0.18 converts it; if not, `builder_error` is a substring of the error
    it raises. note: what the recipe exercises.
    """

    name: str
    config_class: str
    model_class: str
    config: dict[str, Any] = field(default_factory=dict)
    windows: tuple[int, ...] = ()
    rope_switch: int | None = None
    mxfp4: bool = False
    builds: bool = True
    builder_error: str = ""
    note: str = ""

    def hf_config(self) -> Any:
        import transformers

        cls = getattr(transformers, self.config_class)
        if "text_config" in self.config:  # a multimodal config: the tiny shape goes into its text part
            return cls(**{**self.config, "text_config": {**_BASE, **self.config["text_config"]}})
        return cls(**{**_BASE, **self.config})


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("llama", "LlamaConfig", "LlamaForCausalLM"),
        Recipe(
            "mistral",
            "MistralConfig",
            "MistralForCausalLM",
            {"sliding_window": WINDOW},
            windows=(WINDOW,),
            note="window on every layer (normalized: the builder wrote no window)",
        ),
        Recipe("qwen2", "Qwen2Config", "Qwen2ForCausalLM", note="q/k/v biases"),
        Recipe(
            "qwen3",
            "Qwen3Config",
            "Qwen3ForCausalLM",
            {"head_dim": 32},
            note="q/k norms, head_dim != hidden/heads",
        ),
        Recipe(
            "phi3",
            "Phi3Config",
            "Phi3ForCausalLM",
            {
                "hidden_size": 128,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "original_max_position_embeddings": 1024,
            },
            note="Phi-3 short form (no LongRoPE), full rotary",
        ),
        Recipe(
            "phi3_longrope",
            "Phi3Config",
            "Phi3ForCausalLM",
            {
                "hidden_size": 128,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "original_max_position_embeddings": ROPE_SWITCH,
                "rope_parameters": _longrope(64),
            },
            rope_switch=ROPE_SWITCH,
            note="Phi-3.5-mini layout: LongRoPE (short and long caches behind an If)",
        ),
        Recipe(
            "phi4_mini",
            "Phi3Config",
            "Phi3ForCausalLM",
            {
                "hidden_size": 256,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "tie_word_embeddings": True,
                "original_max_position_embeddings": ROPE_SWITCH,
                "rope_parameters": {**_longrope(48), "partial_rotary_factor": 0.75},
            },
            rope_switch=ROPE_SWITCH,
            note="Phi-4-mini layout: LongRoPE, partial rotary 0.75, GQA, tied embeddings",
        ),
        Recipe("gemma", "GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
        Recipe(
            "gemma2",
            "Gemma2Config",
            "Gemma2ForCausalLM",
            {"head_dim": 16, "sliding_window": WINDOW},
            windows=(WINDOW,),
            note="alternating sliding/global layers, logit soft-capping",
        ),
        Recipe(
            "gemma3",
            "Gemma3TextConfig",
            "Gemma3ForCausalLM",
            {
                "head_dim": 32,
                "sliding_window": WINDOW,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            windows=(WINDOW,),
            note="RoPE per layer type (normalized), q/k norms, local and global rotary caches",
        ),
        Recipe(
            "granite",
            "GraniteConfig",
            "GraniteForCausalLM",
            {
                "embedding_multiplier": 2.0,
                "residual_multiplier": 0.5,
                "attention_multiplier": 0.2,
                "logits_scaling": 2.0,
            },
            note="Granite's four multipliers",
        ),
        Recipe(
            "nemotron",
            "NemotronConfig",
            "NemotronForCausalLM",
            {"hidden_size": 128},
            note="partial rotary 0.5 (head_dim 32), LayerNorm1P, squared-ReLU MLP",
        ),
        Recipe(
            "smollm3",
            "SmolLM3Config",
            "SmolLM3ForCausalLM",
            {"num_hidden_layers": 4},
            note="every 4th layer without RoPE (builder patched: KeyError 'position_ids')",
        ),
        Recipe(
            "gptoss",
            "GptOssConfig",
            "GptOssForCausalLM",
            {"head_dim": 16, "sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2},
            windows=(WINDOW,),
            mxfp4=True,
            note="MoE (4 experts, top 2), attention sinks, alternating sliding layers, YaRN, MXFP4 experts",
        ),
        Recipe("ernie4_5", "Ernie4_5Config", "Ernie4_5ForCausalLM", note="interleaved RoPE, head_dim 128"),
        Recipe("olmo", "OlmoConfig", "OlmoForCausalLM", note="non-parametric LayerNorm (epsilon normalized)"),
        # --- the builder cannot convert these -------------------------------------------------------
        Recipe(
            "olmo2",
            "Olmo2Config",
            "Olmo2ForCausalLM",
            builds=False,
            builder_error="is not currently supported",
        ),
        Recipe(
            "qwen3_moe",
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
            builds=False,
            builder_error="is not currently supported",
        ),
        Recipe(
            "mixtral",
            "MixtralConfig",
            "MixtralForCausalLM",
            {"num_local_experts": 4, "num_experts_per_tok": 2},
            builds=False,
            builder_error="is not currently supported",
        ),
        Recipe(
            "phimoe",
            "PhimoeConfig",
            "PhimoeForCausalLM",
            {
                "hidden_size": 128,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "rope_parameters": {**_longrope(64), "short_mscale": 1.0, "long_mscale": 1.2},
            },
            builds=False,
            builder_error="The longrope RoPE style is not currently supported",
            note="transformers 5 names it PhimoeForCausalLM (normalized to the builder's PhiMoEForCausalLM)",
        ),
        Recipe(
            "lfm2",
            "Lfm2Config",
            "Lfm2ForCausalLM",
            note="the builder makes it; onnxgen cannot run it (convolution state beside the KV cache)",
        ),
        Recipe(
            "qwen3_5",
            "Qwen3_5Config",
            "Qwen3_5ForConditionalGeneration",
            {
                "text_config": {
                    "num_hidden_layers": 4,
                    "head_dim": 16,
                    "linear_num_key_heads": 2,
                    "linear_num_value_heads": 4,
                    "linear_key_head_dim": 16,
                    "linear_value_head_dim": 16,
                    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                },
                "vision_config": {"hidden_size": 32, "depth": 1, "num_heads": 2, "out_hidden_size": 64},
                "tie_word_embeddings": False,
            },
            note="the builder makes its text decoder; onnxgen cannot run it (linear-attention recurrent state)",
        ),
    )
}

# Built but not runnable by onnxgen: the package exists, `onnxgen convert` refuses with a clear error.
NOT_RUNNABLE = frozenset({"lfm2", "qwen3_5"})


@dataclass(frozen=True)
class ZooBuild:
    """One recipe's outcome: the checkpoint, and the package or the builder's error."""

    name: str
    hf: Path
    package: Path | None
    error: str | None
    seconds: float


def make_checkpoint(recipe: Recipe, dest: Path, *, seed: int = 0) -> Path:
    """Save `recipe`'s model (seeded random weights, fp32) and the byte-level tokenizer into `dest`."""
    import torch
    import transformers

    from onnxgen.convert.synthetic.config import SyntheticConfig
    from onnxgen.convert.synthetic.tokenizer import byte_level_tokenizer

    cfg = recipe.hf_config()
    torch.manual_seed(seed)
    model = getattr(transformers, recipe.model_class)(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights, so a dropped or misplaced norm shows
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                # around 1 (x * w), or around 0 where the model adds the 1 itself (Gemma, Nemotron: x * (1 + w))
                centre = 1.0 if float(p.abs().mean()) > 0.5 else 0.0
                p.uniform_(centre - 0.5, centre + 0.5)
    if recipe.mxfp4:
        mx = _round_experts_to_mxfp4(model)
    model.save_pretrained(dest)
    if recipe.mxfp4:
        from safetensors.torch import load_file, save_file

        state = load_file(str(dest / "model.safetensors"))
        save_file({**state, **mx}, str(dest / "model.safetensors"), metadata={"format": "pt"})
    byte_level_tokenizer(
        SyntheticConfig(vocab_size=VOCAB, context_length=_BASE["max_position_embeddings"])
    ).write(dest)
    return dest


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def mxfp4_encode(w: Any) -> tuple[Any, Any]:
    """Round `w` (`[E, N, K]` float, output-major, K a multiple of 32) to MXFP4 as gpt-oss checkpoints store
    it: blocks `[E, N, K/32, 16]` uint8 (e2m1 codes, even k in the low nibble) and scales `[E, N, K/32]`
    uint8 (e8m0: 2^(s - 127), the smallest power of two that keeps the block within +-6)."""
    import torch

    e, n, k = w.shape
    x = w.detach().float().reshape(e, n, k // 32, 32)
    amax = x.abs().amax(-1).clamp_min(2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    y = x / torch.pow(2.0, exp).unsqueeze(-1)
    mags = torch.tensor(_E2M1)
    code = (y.abs().unsqueeze(-1) - mags).abs().argmin(-1).to(torch.uint8) | ((y < 0).to(torch.uint8) << 3)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).contiguous()
    return blocks, (exp + 127).to(torch.uint8).contiguous()


def mxfp4_decode(blocks: Any, scales: Any) -> Any:
    """The inverse of `mxfp4_encode`: `[E, N, K]` float32."""
    import torch

    codes = torch.stack((blocks & 0x0F, blocks >> 4), -1).reshape(*blocks.shape[:-1], 32)
    vals = torch.tensor(_E2M1)[(codes & 7).long()]
    vals = torch.where((codes & 8) != 0, -vals, vals)
    return (vals * torch.pow(2.0, scales.float() - 127).unsqueeze(-1)).reshape(
        blocks.shape[0], blocks.shape[1], -1
    )


def _round_experts_to_mxfp4(model: Any) -> dict[str, Any]:
    """Replace each gpt-oss expert weight by its MXFP4 rounding; return the MXFP4 tensors to save beside."""
    import torch

    out: dict[str, Any] = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            experts = layer.mlp.experts
            for proj in ("gate_up_proj", "down_proj"):
                w = getattr(experts, proj)  # [E, in, out]: input-major
                blocks, scales = mxfp4_encode(w.transpose(1, 2))
                w.copy_(mxfp4_decode(blocks, scales).transpose(1, 2))
                out[f"model.layers.{i}.mlp.experts.{proj}_blocks"] = blocks
                out[f"model.layers.{i}.mlp.experts.{proj}_scales"] = scales
    return out


def _build_here(root: Path, names: list[str], precision: str) -> dict[str, dict[str, Any]]:
    import shutil
    import traceback

    from onnxgen.convert.builder_config import builder_source
    from onnxgen.convert.builder_run import build
    from onnxgen.package import load_spec

    out: dict[str, dict[str, Any]] = {}
    for name in names:
        t0 = time.perf_counter()
        d = root / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        hf = make_checkpoint(RECIPES[name], d / "hf")
        try:
            src, _ = builder_source(hf, d / "work", check=False)
            pkg = build(src, d / "pkg", precision=precision, cache_dir=root / ".cache")
            if name not in NOT_RUNNABLE:
                load_spec(pkg)
            error = None
        except Exception as exc:  # the builder raises anything; record it
            error = f"{type(exc).__name__}: {exc}"
            (d / "error.txt").write_text(error + "\n\n" + traceback.format_exc(), encoding="utf-8")
            shutil.rmtree(d / "pkg", ignore_errors=True)
        out[name] = {"error": error, "seconds": round(time.perf_counter() - t0, 2)}
    return out


def build_zoo(
    names: list[str], root: Path, *, precision: str = "fp32", timeout: float = 600
) -> dict[str, ZooBuild]:
    """Build `names` (keys of RECIPES) under `root` in one subprocess; return each one's `ZooBuild`.

    Raises RuntimeError (with the subprocess's output) when the subprocess itself fails.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        raise KeyError(f"no recipes {unknown}; known: {', '.join(RECIPES)}")
    res = subprocess.run(
        [sys.executable, "-m", "onnxgen.convert.zoo", str(root), *names, "--precision", precision],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=envs.subprocess_env(TOKENIZERS_PARALLELISM="false"),
    )
    summary = root / "zoo.json"
    if res.returncode != 0 or not summary.is_file():
        raise RuntimeError(
            f"building the zoo failed (exit {res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        )
    data = json.loads(summary.read_text(encoding="utf-8"))
    return {
        n: ZooBuild(
            n,
            root / n / "hf",
            None if data[n]["error"] else root / n / "pkg",
            data[n]["error"],
            data[n]["seconds"],
        )
        for n in names
    }


def _main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m onnxgen.convert.zoo", description=__doc__.split("\n")[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("names", nargs="*", help=f"recipes (default: all): {', '.join(RECIPES)}")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "int4"))
    args = ap.parse_args(argv)
    data = _build_here(args.root, args.names or list(RECIPES), args.precision)
    (args.root / "zoo.json").write_text(json.dumps(data, indent=2), encoding="utf-8")
    for name, d in data.items():
        print(f"{name:14s} {d['seconds']:6.2f} s  {d['error'] or 'ok'}"[:200])
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
