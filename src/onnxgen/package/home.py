"""Where onnxgen keeps its files: `$ONNXGEN_HOME` (default `~/.cache/onnxgen`)."""

from __future__ import annotations

import os
from pathlib import Path

# The embedded default model, SmolLM2-135M-Instruct, in two packages built from the same GGUF: int4 (what
# "default" means: the fast one on a CPU) and fp32 (the reference that parity tests and benchmarks name).
DEFAULT_PRECISION = "int4"
DEFAULT_MODELS = {"int4": "smollm2-135m-instruct-int4", "fp32": "smollm2-135m-instruct-fp32"}
DEFAULT_ALIASES = {"": "int4", "default": "int4", "default-int4": "int4", "default-fp32": "fp32"}


def onnxgen_home() -> Path:
    """The root folder for built models and downloaded sources."""
    import onnxgen.envs as envs

    return envs.read("HOME")


def models_dir() -> Path:
    return onnxgen_home() / "models"


def sources_dir() -> Path:
    """Downloaded source checkpoints (e.g. the SmolLM2 GGUF) live here."""
    return onnxgen_home() / "sources"


def default_model_dir(precision: str = DEFAULT_PRECISION) -> Path:
    """The package folder of the embedded default model in `precision` ("int4" or "fp32"; may not exist yet)."""
    return models_dir() / DEFAULT_MODELS[precision]


def default_precision(path: str | os.PathLike[str] | None) -> str | None:
    """Which default package `path` names: omitted, empty or `default` the int4 one, `default-int4` /
    `default-fp32` that precision; None when `path` is not one of these names."""
    return DEFAULT_PRECISION if path is None else DEFAULT_ALIASES.get(str(path))


def is_default(path: str | os.PathLike[str] | None) -> bool:
    """True when `path` names a default package (see `default_precision`)."""
    return default_precision(path) is not None
