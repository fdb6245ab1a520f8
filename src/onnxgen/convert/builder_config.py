"""What onnxruntime-genai's model builder needs from a Hugging Face checkpoint, and where it cannot help.

The builder (0.18) reads a transformers config with assumptions from transformers 4; a transformers-5
checkpoint breaks some of them, and a few builder classes misread a checkpoint silently (the package
then differs from transformers). This module works on `config.json` alone (plain dicts, nothing heavy
imported), before the builder runs:

- `check_architecture(cfg)` raises `ConversionError` naming the architecture when the builder cannot
  convert it (not in its dispatch, or a known failure of this builder version), or when onnxgen cannot
  run what it would make. It is cheap, so `onnxgen convert` fails in a second, not after minutes.
- `normalize_config(cfg)` returns the config the builder reads correctly, and one note per change:

  | checkpoint | what transformers 5 writes | what the builder gets |
  |---|---|---|
  | Gemma 3 | `rope_parameters` per layer type (`full_attention`, `sliding_attention`) | the global layers' `rope_parameters`, `rope_local_base_freq` = the sliding layers' base (builder: `KeyError: 'rope_type'`); set on the loaded config by `builder_run.py`, since transformers 5 re-nests a flat form when it loads it |
  | Mistral, Phi-3 | `sliding_window` for every layer, no `layer_types` | `layer_types` all `sliding_attention` (builder: `local_window_size -1`, no window) |
  | OLMo | no norm epsilon (transformers hard-codes 1e-5) | `rms_norm_eps` 1e-5 (the builder's default is 1e-6) |
  | Nemotron | `norm_eps` | `rms_norm_eps` (the builder reads only that; its default is 1e-6) |
  | Phi-3 LongRoPE | `rope_parameters` with `rope_type` only | also the legacy `type` (builder: `KeyError: 'type'`); on the loaded config, by `builder_run.py` |

- `builder_source(hf_dir, work)` hands the builder `hf_dir` itself when nothing changes, else a folder in
  `work` with links to every file of `hf_dir` and the normalized `config.json`.

Builder bugs that no config can avoid are patched in the builder's own process (`convert/builder_run.py`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
from copy import deepcopy
from pathlib import Path
from typing import Any

from onnxgen.errors import ConversionError

# Architectures whose packages carry per-layer state onnxgen's backends do not keep (convolution or
# recurrent state beside the KV cache): the builder makes them, onnxgen cannot run them.
STATEFUL_ARCHITECTURES = {
    "Lfm2ForCausalLM": "LFM2's short-convolution layers carry a state beside the KV cache",
    "Lfm2MoeForCausalLM": "LFM2's short-convolution layers carry a state beside the KV cache",
    "Lfm2VlForConditionalGeneration": "LFM2's short-convolution layers carry a state beside the KV cache",
    "Qwen3_5ForConditionalGeneration": "Qwen3.5's linear-attention layers carry a recurrent state",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3.5's linear-attention layers carry a recurrent state",
    "GraniteMoeHybridForCausalLM": "Granite 4's Mamba layers carry a recurrent state",
}

# transformers 5 class names the builder knows under another name.
ARCHITECTURE_ALIASES = {"PhimoeForCausalLM": "PhiMoEForCausalLM"}

# Known failures of builder 0.18 on transformers-5 checkpoints that no config change avoids.
BUILDER_018_FAILURES = {
    "PhiMoEForCausalLM": (
        "its PhiMoE class reads no LongRoPE settings (`NotImplementedError: The longrope RoPE style is not "
        "currently supported`), expects transformers 4's `block_sparse_moe` module (transformers 5: `mlp`), and "
        "builds for CUDA only (int4 QMoE)"
    ),
}

# Architectures whose transformers models apply `sliding_window` to every layer when it is set.
_WINDOW_ON_EVERY_LAYER = frozenset({"MistralForCausalLM", "Phi3ForCausalLM"})

_OLMO_NORM_EPS = 1e-5  # transformers' OlmoLayerNorm


def builder_version() -> str | None:
    """The installed onnxruntime-genai's version (None when it is not installed). Imports nothing."""
    try:
        return importlib.metadata.version("onnxruntime-genai")
    except importlib.metadata.PackageNotFoundError:
        return None


def builder_architectures() -> frozenset[str] | None:
    """The architectures the installed builder dispatches on (`config.architectures[0] == "..."` in its
    `builder.py`), read from its source without importing it; None when it cannot be found."""
    spec = importlib.util.find_spec("onnxruntime_genai")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        src = Path(root) / "models" / "builder.py"
        if src.is_file():
            text = src.read_text(encoding="utf-8", errors="replace")
            return frozenset(re.findall(r"architectures\[0\]\s*==\s*\"(\w+)\"", text))
    return None


def architecture(cfg: dict[str, Any]) -> str | None:
    """The checkpoint's architecture (`architectures[0]`), None when the config names none."""
    archs = cfg.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    return None


def check_architecture(cfg: dict[str, Any], *, version: str | None = None) -> None:
    """Raise ConversionError when converting a checkpoint with this config cannot give a package onnxgen
    runs as transformers does: the builder does not know the architecture, this builder version is known
    to fail on it, or onnxgen cannot run the package. `version` defaults to the installed builder's."""
    arch = architecture(cfg)
    if arch is None:
        raise ConversionError(
            "config.json names no architecture ('architectures'); the model builder dispatches on it. "
            'Add the transformers class name, e.g. "architectures": ["LlamaForCausalLM"]'
        )
    name = ARCHITECTURE_ALIASES.get(arch, arch)
    version = version or builder_version() or ""
    if arch in STATEFUL_ARCHITECTURES:
        raise ConversionError(
            f"onnxgen cannot run {arch} packages: {STATEFUL_ARCHITECTURES[arch]}, which neither backend "
            "keeps between steps; convert a decoder-only attention model"
        )
    if version.startswith("0.18.") and name in BUILDER_018_FAILURES:
        raise ConversionError(
            f"the model builder (onnxruntime-genai {version}) cannot convert {arch}: {BUILDER_018_FAILURES[name]}"
        )
    known = builder_architectures()
    if known is not None and name not in known:
        text = sorted(a for a in known if a.endswith("ForCausalLM") and a not in STATEFUL_ARCHITECTURES)
        raise ConversionError(
            f"the model builder (onnxruntime-genai {version or '?'}) does not support the architecture {arch} "
            f"(model_type {cfg.get('model_type')!r}); the decoder-only architectures it converts: {', '.join(text)}"
        )
    if cfg.get("model_type") == "olmo" and cfg.get("clip_qkv") is not None:
        raise ConversionError(
            f"the model builder ignores OLMo's clip_qkv ({cfg['clip_qkv']}): the package would differ from "
            "transformers; this checkpoint cannot be converted faithfully"
        )


# GGUF `general.architecture` -> the transformers class its Hugging Face folder gets (text models).
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "nemotron": "NemotronForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "falcon": "FalconForCausalLM",
    "stablelm": "StableLmForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "bloom": "BloomForCausalLM",
    "mamba": "MambaForCausalLM",
}


# GGUF metadata value types -> struct format of a scalar (8: string, 9: array; see `gguf_metadata`).
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_metadata(path: Path, keys: set[str]) -> dict[str, Any]:
    """The scalar and string values of `keys` in the GGUF file `path`'s header (arrays are skipped; absent
    keys are left out). Reads the header's key-value section only (the first few KB; no tensor is read,
    nothing is imported). Raises ConversionError for a file that is not GGUF."""
    import struct

    def read(f: Any, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        raw = f.read(size)
        if len(raw) != size:
            raise ConversionError(f"{path}: the GGUF header ends early")
        return struct.unpack("<" + fmt, raw)[0]

    def string(f: Any) -> bytes:
        return f.read(read(f, "Q"))

    def value(f: Any, vtype: int) -> Any:
        if vtype == 8:
            return string(f).decode("utf-8", errors="replace")
        if vtype == 9:
            item, count = read(f, "I"), read(f, "Q")
            for _ in range(count):
                value(f, item)
            return None
        if vtype in _GGUF_SCALARS:
            return read(f, _GGUF_SCALARS[vtype])
        raise ConversionError(f"{path}: unknown GGUF value type {vtype}")

    found: dict[str, Any] = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ConversionError(f"{path}: not a GGUF file (no GGUF magic)")
        read(f, "I")  # version
        read(f, "Q")  # tensor count
        for _ in range(read(f, "Q")):
            key, vtype = string(f).decode("utf-8", errors="replace"), read(f, "I")
            v = value(f, vtype)
            if key in keys and v is not None:
                found[key] = v
                if len(found) == len(keys):
                    break
    return found


def gguf_architecture(path: Path) -> str:
    """`general.architecture` of the GGUF file `path` (ConversionError when it names none)."""
    arch = gguf_metadata(path, {"general.architecture"}).get("general.architecture")
    if not isinstance(arch, str):
        raise ConversionError(f"{path}: the GGUF header names no general.architecture")
    return arch


def check_gguf(path: Path) -> None:
    """`check_architecture` for a GGUF file, from its header alone (before minutes of dequantizing).
    Raises ConversionError for an architecture transformers cannot turn into a Hugging Face folder or the
    builder cannot convert."""
    arch = gguf_architecture(path)
    cls = GGUF_ARCHITECTURES.get(arch)
    if cls is None:
        raise ConversionError(
            f"{path}: GGUF architecture {arch!r} is not one onnxgen converts (transformers reads it into a "
            f"Hugging Face folder, then the model builder); known: {', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    check_architecture({"architectures": [cls], "model_type": arch})


def normalize_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Return (the config the builder reads correctly, one note per change); `cfg` is not modified.

    Raises ConversionError for a Gemma 3 rope setting the builder cannot express (scaled sliding layers).
    """
    out = deepcopy(cfg)
    notes: list[str] = []
    arch = architecture(out)
    if arch in ARCHITECTURE_ALIASES:
        out["architectures"] = [ARCHITECTURE_ALIASES[arch], *out["architectures"][1:]]
        notes.append(f"architectures: {arch} -> {ARCHITECTURE_ALIASES[arch]} (the builder's name)")
    targets = [out]
    if isinstance(out.get("text_config"), dict):
        targets.append(out["text_config"])
    for c in targets:
        notes += _flatten_layer_type_rope(c)
        if arch in _WINDOW_ON_EVERY_LAYER:
            notes += _window_on_every_layer(c)
    if out.get("model_type") == "olmo" and "rms_norm_eps" not in out:
        out["rms_norm_eps"] = _OLMO_NORM_EPS
        notes.append("rms_norm_eps: 1e-5 (transformers' OLMo layer norm; the builder's default is 1e-6)")
    if out.get("model_type") == "nemotron" and "rms_norm_eps" not in out and "norm_eps" in out:
        out["rms_norm_eps"] = out["norm_eps"]
        notes.append(
            f"rms_norm_eps: {out['norm_eps']} (Nemotron's norm_eps; the builder reads rms_norm_eps only)"
        )
    return out, notes


def flat_layer_type_rope(rp: object) -> tuple[dict[str, Any], float] | None:
    """For RoPE settings per layer type (`{"full_attention": {...}, "sliding_attention": {...}}`, Gemma 3 in
    transformers 5): (the global layers' settings, the sliding layers' base), the form the builder reads;
    None for any other form. Raises ConversionError for settings the builder cannot express."""
    if not (isinstance(rp, dict) and rp and set(rp) <= {"full_attention", "sliding_attention"}):
        return None
    full, local = rp.get("full_attention"), rp.get("sliding_attention")
    if not isinstance(full, dict) or not isinstance(local, dict):
        raise ConversionError(
            f"rope_parameters per layer type without both full_attention and sliding_attention ({rp!r}); "
            "the model builder needs both"
        )
    if local.get("rope_type", "default") != "default":
        raise ConversionError(
            f"the sliding layers' RoPE is {local.get('rope_type')!r}; the model builder gives sliding layers "
            "the default RoPE with their own base only"
        )
    if full.get("rope_type", "default") != "default":
        # NOTE: the builder computes its local cache with the global layers' scaling too (one rope_attrs).
        raise ConversionError(
            f"the global layers' RoPE is {full.get('rope_type')!r}; the model builder (0.18) would apply that "
            "scaling to the sliding layers as well, so the package would differ from transformers"
        )
    return dict(full), float(local["rope_theta"])


def _flatten_layer_type_rope(c: dict[str, Any]) -> list[str]:
    flat = flat_layer_type_rope(c.get("rope_parameters"))
    if flat is None:
        return []
    # NOTE: transformers 5 turns a flat form back into per-layer-type settings when it loads the config,
    # so the flattening happens on the loaded config object, in the builder's process (builder_run.py).
    return [
        f"rope_parameters per layer type -> the global layers' (base {flat[0]['rope_theta']}) and "
        f"rope_local_base_freq {flat[1]} (on the loaded config, in the builder's process)"
    ]


def _window_on_every_layer(c: dict[str, Any]) -> list[str]:
    window = c.get("sliding_window")
    n = c.get("num_hidden_layers")
    if not isinstance(window, int) or window <= 0 or c.get("layer_types") or not isinstance(n, int):
        return []
    c["layer_types"] = ["sliding_attention"] * n
    return [f"layer_types: every layer sliding_attention (window {window}, as transformers applies it)"]


def builder_source(hf_dir: Path, work: Path, *, check: bool = True) -> tuple[Path, list[str]]:
    """The folder to give the builder for `hf_dir`, and the notes of `normalize_config`.

    Checks the architecture first (`check_architecture`; `check=False` skips it, to see the builder's own
    failure). When the config needs no change this is
    `hf_dir`; otherwise a new folder `work/hf-normalized` with a symbolic link to every entry of `hf_dir`
    (copied where links are not possible) and the normalized `config.json`. `hf_dir` is never modified.
    """
    cfg = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    if not isinstance(cfg, dict):
        raise ConversionError(f"{hf_dir / 'config.json'}: must hold a JSON object")
    if check:
        check_architecture(cfg)
    fixed, notes = normalize_config(cfg)
    if not notes:
        return hf_dir, []
    dest = work / "hf-normalized"
    dest.mkdir(parents=True)
    for entry in hf_dir.iterdir():
        if entry.name == "config.json":
            continue
        try:
            os.symlink(entry.absolute(), dest / entry.name, target_is_directory=entry.is_dir())
        except OSError:
            import shutil

            (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, dest / entry.name)
    (dest / "config.json").write_text(json.dumps(fixed, indent=2), encoding="utf-8")
    return dest, notes


__all__ = ["builder_source", "check_architecture", "check_gguf", "normalize_config"]
