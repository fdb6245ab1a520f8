"""Where onnxgen keeps its files: `$ONNXGEN_HOME` (default `~/.cache/onnxgen`)."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_NAME = "smollm2-135m-instruct-fp32"
DEFAULT_ALIASES = (None, "", "default")


def onnxgen_home() -> Path:
    """The root folder for built models and downloaded sources."""
    import onnxgen.envs as envs

    return envs.read("HOME")


def models_dir() -> Path:
    return onnxgen_home() / "models"


def sources_dir() -> Path:
    """Downloaded source checkpoints (e.g. the SmolLM2 GGUF) live here."""
    return onnxgen_home() / "sources"


def default_model_dir() -> Path:
    """The embedded default model's package folder (may not exist yet)."""
    return models_dir() / DEFAULT_MODEL_NAME


def is_default(path: str | os.PathLike[str] | None) -> bool:
    """True when `path` means the default model (omitted, empty or the word `default`)."""
    return path is None or str(path) in ("", "default")
