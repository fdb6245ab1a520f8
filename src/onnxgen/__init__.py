"""onnxgen: run generative ONNX model packages fast, keeping each conversation's KV cache alive.

    import onnxgen
    model = onnxgen.load()                      # the embedded default (SmolLM2-135M-Instruct)
    r = model.generate([{"role": "user", "content": "What is the capital of France?"}])
    print(r.text, r.stats)

Importing onnxgen is light: onnxruntime, torch and friends load only when a backend needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from onnxgen.errors import OnnxgenError

if TYPE_CHECKING:
    from onnxgen.engine.engine import Engine as Model
    from onnxgen.engine.result import Result, Stats
    from onnxgen.engine.session import Session

__version__ = "0.1.0"
__all__ = ["Model", "OnnxgenError", "Result", "Session", "Stats", "load"]


def load(
    path: str | None = None,
    backend: str = "auto",
    device: str = "cpu",
    **options: Any,
) -> Model:
    """Load a model package and return a ready `Model`.

    path: a package folder; omitted (or "default") means the embedded default model, built on first
    use (needs the `convert` extra). backend: "auto" (native on CUDA, ort on CPU), "ort" or
    "native". device: "cpu" or "cuda". options: chunk_size, max_sessions, max_kv_bytes, paged, max_running,
    max_batch_tokens, decode_steps (decode steps per host round trip with paged KV: 8 on CUDA), tool_parser
    (hermes | llama3_json | mistral; default: detected from the chat template), and the options each
    backend declares (`OPTIONS` in `onnxgen.backends.ort` / `onnxgen.backends.native`; a backend
    ignores the other's): threads, kv_mode, last_logits (ort), kv_floor (smallest KV capacity bucket,
    both), cuda_graphs and graph_max_tokens (native on CUDA: replay decode and prefill chunks of up to
    this many tokens, default 1024, from CUDA graphs), static_steps (native, testing).
    Raises `InvalidRequest` for an unknown backend, device or option.
    """
    from onnxgen.convert.default import resolve_model_path
    from onnxgen.engine.engine import Engine
    from onnxgen.package.spec import load_spec

    spec = load_spec(resolve_model_path(path))
    return Engine(spec, backend=backend, device=device, **options)


def __getattr__(name: str) -> Any:
    if name == "Model":
        from onnxgen.engine.engine import Engine

        return Engine
    if name in ("Result", "Stats"):
        from onnxgen.engine import result

        return getattr(result, name)
    if name == "Session":
        from onnxgen.engine.session import Session

        return Session
    raise AttributeError(name)
