"""Backends run a package's graph behind the `Decoder` protocol (see `base.py`).

Heavy dependencies are imported lazily: choosing the ort backend never imports torch. Each backend
package declares the keyword options its decoder takes (`OPTIONS` in `backends/ort/__init__.py` and
`backends/native/__init__.py`); `backend_options()` collects those declarations for the engine, which
checks the user's options against them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from onnxgen.errors import BackendUnavailable, InvalidRequest

if TYPE_CHECKING:
    from onnxgen.backends.base import Decoder
    from onnxgen.backends.batch import BatchRunner
    from onnxgen.package.spec import ModelSpec

BACKENDS = ("auto", "ort", "native")
DEVICES = ("cpu", "cuda")


def backend_options() -> dict[str, tuple[str, ...]]:
    """The keyword options each concrete backend declares (its decoder's and its batched runner's), by
    backend name (imports no backend)."""
    from onnxgen.backends import native, ort

    return {"ort": ort.OPTIONS, "native": (*native.OPTIONS, *native.RUNNER_OPTIONS, *native.TP_OPTIONS)}


def resolve_backend(backend: str, device: str) -> str:
    """Return the concrete backend for `backend` on `device`: `auto` picks native on CUDA, ort on CPU.

    The one check of the user's backend and device names (the engine calls it; decoders only assert):
    raises `InvalidRequest` for an unknown one."""
    if backend not in BACKENDS:
        raise InvalidRequest(
            f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}", field="backend"
        )
    if device not in DEVICES:
        raise InvalidRequest(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}", field="device")
    if backend == "auto":
        return "native" if device == "cuda" else "ort"
    return backend


def create_decoder(spec: ModelSpec, backend: str, device: str, **options: Any) -> Decoder:
    """Build a decoder for `spec`. `backend` must already be resolved ("ort" or "native") and `device`
    checked (`resolve_backend`). `options` were checked against `backend_options()` by the caller; the
    decoder gets those its backend declares (a backend ignores another's options, so one set of options
    works with backend="auto"). Raises `BackendUnavailable` when the backend's dependencies are missing."""
    assert backend in ("ort", "native") and device in DEVICES, (backend, device)
    declared = backend_options()
    assert set(options) <= {o for opts in declared.values() for o in opts}, (
        f"unchecked options {sorted(options)}"
    )
    from onnxgen.backends import native, ort

    own = ort.OPTIONS if backend == "ort" else (*native.OPTIONS, *native.TP_OPTIONS)
    mine = {k: v for k, v in options.items() if k in own}
    decoder: Any
    if backend == "ort":
        from onnxgen.backends.ort.decoder import OrtDecoder

        decoder = OrtDecoder(spec, device=device, **mine)
    else:
        try:
            from onnxgen.backends.native.decoder import NativeDecoder
        except ImportError as exc:  # torch or onnx-ir missing
            raise BackendUnavailable(
                f"the native backend needs the 'native' extra ({exc}): pip install 'onnxgen[native]'"
            ) from exc
        tp = mine.pop("tensor_parallel", 1)
        if tp > 1:
            from onnxgen.backends.native.tp.decoder import TPDecoder

            decoder = TPDecoder.start(spec, device, tp, **mine)
        else:
            decoder = NativeDecoder(spec, device=device, **mine)
    if spec.multimodal is None:
        return decoder
    from onnxgen.backends.multimodal import MultimodalDecoder, Parts  # the image pipeline ahead of it

    return MultimodalDecoder(decoder, Parts(spec, backend, device, threads=options.get("threads")))


def create_runner(
    spec: ModelSpec, backend: str, device: str, *, max_batch: int, **options: Any
) -> BatchRunner:
    """Build a batched runner over a paged KV pool for `spec` (see `backends/batch.py`) for steps of up to
    `max_batch` sequences, with the runner options its backend declares (others are ignored); with
    `tensor_parallel` N > 1 a `tp.runner.TPRunner` over N ranks. Raises `BackendUnavailable` when the backend
    has no batched runner or cannot batch this package."""
    assert backend in ("ort", "native") and device in DEVICES, (backend, device)
    if backend != "native":
        raise BackendUnavailable(f"the {backend} backend runs one request per decoder (no batched runner)")
    if spec.multimodal is not None:
        raise BackendUnavailable(
            "the batched runner does not run image pipelines yet (one decoder per request)"
        )
    from onnxgen.backends import native

    try:
        from onnxgen.backends.native.runner import NativeRunner
    except ImportError as exc:  # torch or onnx-ir missing
        raise BackendUnavailable(
            f"the native backend needs the 'native' extra ({exc}): pip install 'onnxgen[native]'"
        ) from exc
    mine = {k: v for k, v in options.items() if k in native.RUNNER_OPTIONS}
    tp = options.get("tensor_parallel", 1)
    if tp > 1:
        from onnxgen.backends.native.tp.runner import TPRunner

        return TPRunner.start(spec, device, tp, max_batch=max_batch, **mine)
    return NativeRunner(spec, device=device, max_batch=max_batch, **mine)
