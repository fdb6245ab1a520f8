"""Backends run a package's graph behind the `Decoder` protocol (see `base.py`).

Heavy dependencies are imported lazily: choosing the ort backend never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from onnxgen.errors import BackendUnavailable, InvalidRequest

if TYPE_CHECKING:
    from onnxgen.backends.base import Decoder
    from onnxgen.package.spec import ModelSpec

BACKENDS = ("auto", "ort", "native")
DEVICES = ("cpu", "cuda")
# Options each backend takes (a backend ignores the other's, so one call works with backend="auto").
OPTIONS = {
    "ort": ("threads", "kv_floor", "kv_mode", "last_logits"),
    "native": ("kv_floor", "cuda_graphs", "graph_max_tokens", "static_steps"),
}


def resolve_backend(backend: str, device: str) -> str:
    """Return the concrete backend for `backend` on `device`: `auto` picks native on CUDA, ort on CPU."""
    if backend not in BACKENDS:
        raise InvalidRequest(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}", field="backend")
    if device not in DEVICES:
        raise InvalidRequest(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}", field="device")
    if backend == "auto":
        return "native" if device == "cuda" else "ort"
    return backend


def create_decoder(spec: ModelSpec, backend: str, device: str, **options: Any) -> Decoder:
    """Build a decoder for `spec`. `backend` must already be resolved ("ort" or "native").
    Raises `InvalidRequest` for an option no backend takes (a typo must not be silently ignored)."""
    known = sorted({o for opts in OPTIONS.values() for o in opts})
    for name in options:
        if name.startswith("_"):
            continue  # internal (e.g. a forked decoder's shared session)
        if name not in known:
            raise InvalidRequest(
                f"unknown option {name!r}; load() takes chunk_size, max_sessions, max_kv_bytes, tool_parser and the "
                f"backend options {', '.join(known)}",
                field=name,
            )
    if backend == "ort":
        from onnxgen.backends.ort.decoder import OrtDecoder

        return OrtDecoder(spec, device=device, **options)
    if backend == "native":
        try:
            from onnxgen.backends.native.decoder import NativeDecoder
        except ImportError as exc:  # torch or onnx-ir missing
            raise BackendUnavailable(
                f"the native backend needs the 'native' extra ({exc}): pip install 'onnxgen[native]'"
            ) from exc
        return NativeDecoder(spec, device=device, **options)
    raise InvalidRequest(f"unknown backend {backend!r}", field="backend")
