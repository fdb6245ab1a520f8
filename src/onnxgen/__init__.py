"""onnxgen: run generative ONNX model packages fast, keeping each conversation's KV cache alive.

    import onnxgen
    model = onnxgen.load()                      # the embedded default (SmolLM2-135M-Instruct)
    r = model.generate([{"role": "user", "content": "What is the capital of France?"}])
    print(r.text, r.stats)

Importing onnxgen is light: onnxruntime, torch and friends load only when a backend needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from onnxgen.config import CacheConfig, Config, DecodingConfig, ModelConfig, SchedulerConfig
from onnxgen.errors import OnnxgenError
from onnxgen.sampling.params import SamplingParams

if TYPE_CHECKING:
    from onnxgen.engine.input import Prepared
    from onnxgen.engine.model import Model
    from onnxgen.engine.output import Handle, Result, Stats
    from onnxgen.engine.session import Session

__version__ = "0.1.0"
__all__ = [
    "CacheConfig",
    "Config",
    "DecodingConfig",
    "Handle",
    "Model",
    "ModelConfig",
    "OnnxgenError",
    "Prepared",
    "Result",
    "SamplingParams",
    "SchedulerConfig",
    "Session",
    "Stats",
    "load",
]

_LAZY = {
    "Model": "onnxgen.engine.model",
    "Handle": "onnxgen.engine.output",
    "Result": "onnxgen.engine.output",
    "Stats": "onnxgen.engine.output",
    "Session": "onnxgen.engine.session",
    "Prepared": "onnxgen.engine.input",
}


def load(path: str | None = None, config: Config | None = None, **overrides: Any) -> Model:
    """Load a model package and return a ready `Model`.

    path: a package folder; omitted (or "default") means the embedded default model, built on first use
    (needs the `convert` extra). config: an `onnxgen.Config` (default: every field's default). overrides: any
    field of the config by its name, e.g. `load("pkg", backend="native", device="cuda", max_running=32)`
    (`Config.options()` lists them: backend, device, int4, threads, chunk_size, max_sessions, paged, kv_bytes,
    max_running, max_batch_tokens, decode_steps, speculative, ...). Raises `InvalidRequest` naming an unknown
    option or a bad value, `BackendUnavailable` when a backend's dependencies are missing, and the package's
    load errors.
    """
    from onnxgen.convert.default import resolve_model_path
    from onnxgen.engine.model import Model
    from onnxgen.package.spec import load_spec

    cfg = (config if config is not None else Config()).replace(**overrides)
    spec = load_spec(resolve_model_path(path))
    return Model.from_spec(spec, cfg)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'onnxgen' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
