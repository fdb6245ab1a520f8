"""Shared fixtures: the real default model (built on first use) and tiny synthetic packages."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hypothesis import settings

# No example database: a failure found in one run is not silently replayed in every later run of the
# checkout (CI starts clean anyway); each run draws fresh examples.
settings.register_profile("onnxgen", database=None)
settings.load_profile("onnxgen")


def has_cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def native_available() -> bool:
    return (
        importlib.util.find_spec("torch") is not None
        and importlib.util.find_spec("onnxgen.backends.native.decoder") is not None
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs CUDA (runs on the GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _release_cuda_memory(request: pytest.FixtureRequest):
    """After a GPU test, return the memory its models freed to the device: a CUDA engine sizes its KV pool
    from the free memory, and blocks cached by torch's allocator for another stream are not reusable by
    the next test's allocations (a later test otherwise ran out of memory with 133 GiB reserved)."""
    yield
    if "gpu" in request.keywords and has_cuda():
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded default model's fp32 package (SmolLM2-135M-Instruct; `default-fp32`, the reference the
    tests compare against), built once if missing."""
    from onnxgen.convert.default import ensure_default_model

    return ensure_default_model(precision="fp32")


@pytest.fixture(scope="session")
def smollm2_ort(smollm2_dir: Path):
    import onnxgen

    return onnxgen.load(str(smollm2_dir), backend="ort", threads=2)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny fp32 builder-style (GroupQueryAttention) package with random weights."""
    from onnxgen.convert.synthetic import SyntheticConfig, write_package

    return write_package(
        tmp_path_factory.mktemp("tiny") / "pkg", SyntheticConfig(num_layers=2, context_length=1024)
    )


@pytest.fixture(scope="session")
def tiny_plain_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny fp32 package with plain ai.onnx attention (explicit past/present concat)."""
    from onnxgen.convert.synthetic import SyntheticConfig, write_package

    cfg = SyntheticConfig(num_layers=2, context_length=1024, attention="plain")
    return write_package(tmp_path_factory.mktemp("tiny_plain") / "pkg", cfg)


@pytest.fixture(scope="session")
def qwen_vl_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Qwen2.5-VL: the seeded random transformers checkpoint and its package (builder text decoder,
    vision and embedding graphs: `onnxgen.convert.qwen_vl`), built once per session."""
    pytest.importorskip("transformers")
    pytest.importorskip("PIL")
    from onnxgen.convert.qwen_vl import VLShape, qwen_vl_package, random_qwen_vl_checkpoint

    root = tmp_path_factory.mktemp("qwen_vl")
    hf = random_qwen_vl_checkpoint(root / "hf", VLShape())
    return hf, qwen_vl_package(hf, root / "pkg", cache_dir=root / "cache")


@pytest.fixture(scope="session")
def qwen_vl_dir(qwen_vl_dirs: tuple[Path, Path]) -> Path:
    return qwen_vl_dirs[1]
