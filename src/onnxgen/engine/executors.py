"""Which KV executor an engine gets: the paged pool (`engine/paged.PagedKV`, the native backend on packages
it can batch) or one decoder per request (`engine/slots.SlotKV`: ort, and native packages it cannot batch).

Both answer the same calls from the scheduler and the step (`admit`, `run`, `finish`, `release`, `drop`,
`stats` ...); the engine does not ask which one it holds except through `executor.paged`.
"""

from __future__ import annotations

import threading
from typing import Any

from onnxgen.backends import create_decoder, create_runner
from onnxgen.config import Config
from onnxgen.engine.slots import DecoderPool, SlotKV
from onnxgen.errors import BackendUnavailable, InvalidRequest
from onnxgen.package.spec import ModelSpec


def build_executor(spec: ModelSpec, config: Config, backend: str) -> Any:
    """The paged pool when the backend is native, `cache.paged` is not False and the backend can batch the
    package (with `tensor_parallel`, over a `TPRunner`); otherwise a `SlotKV` over a pool of decoders forked from one loaded prototype (which shares the
    weights). Raises `BackendUnavailable` (the backend's dependencies are missing, or `cache.paged=True`
    where it cannot batch) and the backend's load errors."""
    device, options = config.model.device, config.backend_options()
    tp = config.model.tensor_parallel
    if tp > 1 and backend != "native":
        raise InvalidRequest(
            f"tensor_parallel={tp} needs the native backend (this engine runs {backend})",
            field="tensor_parallel",
        )
    if config.cache.paged is not False and backend == "native":
        host_bytes = config.cache.host_bytes_for(config.model.cuda)
        if tp > 1 and host_bytes > 0:
            raise BackendUnavailable(
                "the host KV tier does not run tensor-parallel yet: load with host_kv_bytes=0 or paged=False"
            )
        try:
            from onnxgen.engine.paged import PagedKV

            max_batch = config.scheduler.running_for(config.model.cuda, True)
            runner = create_runner(spec, backend, device, max_batch=max_batch, **options)
            # a tensor-parallel runner's workers stop with the model
            return PagedKV(runner, host_bytes=host_bytes, on_close=getattr(runner, "shutdown", None))
        except BackendUnavailable:
            if config.cache.paged:
                raise
    elif config.cache.paged:
        raise BackendUnavailable(f"paged KV needs the native backend (this engine runs {backend})")
    prototype = create_decoder(spec, backend, device, **options)
    lock = threading.Lock()

    def fork() -> Any:
        with lock:  # NOTE: a closed decoder stays usable and still forks
            return prototype.fork()

    pool = DecoderPool(fork)
    pool.release(prototype)  # the prototype is an ordinary decoder too
    parts = getattr(prototype, "parts", None)  # a vision package's graphs, shared by the forks
    # stateless requests' contexts, matched by longest prefix: as many as sessions may retain
    return SlotKV(
        pool,
        stateless=config.cache.max_sessions,
        counters=parts.counters if parts else None,
        on_close=getattr(
            prototype, "shutdown", None
        ),  # a tensor-parallel group's workers stop with the model
    )
