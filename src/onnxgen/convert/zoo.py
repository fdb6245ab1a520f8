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
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    switch). builds: whether builder 0.18 converts it; if not, `builder_error` is a substring of the error
    it raises. note: what the recipe exercises.
    """

    name: str
    config_class: str
    model_class: str
    config: dict[str, Any] = field(default_factory=dict)
    windows: tuple[int, ...] = ()
    rope_switch: int | None = None
    builds: bool = True
    builder_error: str = ""
    note: str = ""

    def hf_config(self) -> Any:
        import transformers

        return getattr(transformers, self.config_class)(**{**_BASE, **self.config})


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
            note="MoE (4 experts, top 2), attention sinks, alternating sliding layers, YaRN",
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
    )
}

# Built but not runnable by onnxgen: the package exists, `onnxgen convert` refuses with a clear error.
NOT_RUNNABLE = frozenset({"lfm2"})


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
                p.uniform_(0.5, 1.5) if float(p.detach().abs().mean()) > 0.5 else p.uniform_(-0.5, 0.5)
    model.save_pretrained(dest)
    byte_level_tokenizer(SyntheticConfig(vocab_size=VOCAB, context_length=cfg.max_position_embeddings)).write(
        dest
    )
    return dest


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
    from onnxgen import envs

    res = subprocess.run(
        [sys.executable, "-m", "onnxgen.convert.zoo", str(root), *names, "--precision", precision],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=envs.subprocess_env(),
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
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    data = _build_here(args.root, args.names or list(RECIPES), args.precision)
    (args.root / "zoo.json").write_text(json.dumps(data, indent=2), encoding="utf-8")
    for name, d in data.items():
        print(f"{name:14s} {d['seconds']:6.2f} s  {d['error'] or 'ok'}"[:200])
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
