"""What the native backend's decoders and batched runner share about the device: the torch device of a
name, the KV dtypes, the per-device lock around forwards and graph captures, uploads of small host vectors
that never synchronise the stream, and the lowered program shared by every decoder and runner of a package on
a device (one copy of the weights)."""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import torch

import onnxgen.envs as envs
from onnxgen.backends.native.kernels import cpu_gemm
from onnxgen.backends.native.kernels.dispatch import load_switches
from onnxgen.backends.native.lowering import Program, lower
from onnxgen.errors import BackendUnavailable
from onnxgen.kv.storage import page_bytes

log = logging.getLogger(__name__)

KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CPU_KV_BYTES = 2 << 30  # default pool on the CPU: 2 GiB of address space (pages are touched when written)
GPU_KV_FRACTION = 0.8  # default pool on CUDA: this fraction of the device memory free after the weights


def torch_device(device: str) -> torch.device:
    """The torch device of "cpu" or "cuda" (the current CUDA device). Raises `BackendUnavailable` when
    CUDA is asked for and torch sees none."""
    assert device in ("cpu", "cuda"), f"device {device!r} was not checked (resolve_backend)"
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise BackendUnavailable("device='cuda' but torch sees no CUDA device; use device='cpu'")
    return torch.device("cuda", torch.cuda.current_device())


def kv_dtype(spec: Any) -> torch.dtype:
    """The torch dtype of the package's KV; `BackendUnavailable` when the native backend has none for it."""
    if spec.kv_dtype not in KV_DTYPES:
        raise BackendUnavailable(f"the native backend does not support KV dtype {spec.kv_dtype!r}")
    return KV_DTYPES[spec.kv_dtype]


_DEVICE_LOCKS: dict[str, threading.RLock] = {}
_DEVICE_LOCKS_GUARD = threading.Lock()


class _NoLock:
    """The CPU's `device_lock`: forwards of different decoders run in parallel there."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def device_lock(dev: torch.device) -> Any:
    """The process-wide lock of a CUDA device (one per device index, shared by every decoder and engine on
    it: CUDA graph capture state is per process); a no-op context on the CPU."""
    if dev.type != "cuda":
        return _NoLock()
    # pragma: cuda-begin
    key = str(dev)
    with _DEVICE_LOCKS_GUARD:
        return _DEVICE_LOCKS.setdefault(key, threading.RLock())
    # pragma: cuda-end


class Staging:
    """Host-to-device copies of small integer vectors that never synchronise the stream: pinned
    staging buffers in a ring, each rewritten only after the copy that last read it has completed
    (an event per buffer), so back-to-back forwards cannot race their own uploads."""

    def __init__(self, dev: torch.device, slots: int = 4) -> None:
        self.device = dev
        self._cuda = dev.type == "cuda"
        self._bufs: list[torch.Tensor | None] = [None] * slots
        self._events: list[Any] = [None] * slots
        self._i = 0

    def upload(self, values: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the 1-D integer CPU tensor `values` into the device tensor `out` (same length and dtype)."""
        if not self._cuda:
            out.copy_(values)
            return
        # pragma: cuda-begin (pinned staging buffers)
        i = self._i
        self._i = (i + 1) % len(self._bufs)
        ev = self._events[i]
        if ev is None:
            ev = self._events[i] = torch.cuda.Event()
        else:
            ev.synchronize()
        buf = self._bufs[i]
        k = values.numel() * values.element_size()
        if buf is None or buf.numel() < k:
            buf = self._bufs[i] = torch.empty(max(k, 2048), dtype=torch.uint8).pin_memory()
        staged = buf[:k].view(values.dtype)
        staged.copy_(values)
        out.copy_(staged, non_blocking=True)
        ev.record()
        # pragma: cuda-end


_PROGRAMS: weakref.WeakValueDictionary[tuple[Any, ...], Program] = weakref.WeakValueDictionary()


def int4_mode(int4: str | None) -> str:
    """How MatMulNBits weights run: "dense" (dequantized at load into the model dtype) or "packed" (kept
    packed, `ops.quant`'s Int4Linear: a GEMV for decode rows, a packed GEMM for batches of up to
    `ops.quant.GEMM_ROWS` rows, dequantized per product for longer prefill chunks). None: "dense" — packed
    decodes faster alone, its weights in less memory (docs/benchmarks/decode-gpu.md); its batched throughput
    against dense is measured by `benchmarks/gpu_decode.py` and `batch.py`. Raises InvalidRequest for other
    values."""
    if int4 is None:
        return "dense"
    if int4 not in ("dense", "packed"):
        from onnxgen.errors import InvalidRequest

        raise InvalidRequest(f"int4 must be 'dense' or 'packed', got {int4!r}", field="int4")
    return int4


def shared_program(spec: Any, dev: torch.device, int4: str | None = None) -> Program:
    """Decoders of one package on one device share the lowered program (and so the weights); `int4` as
    `int4_mode` reads it. Reads the kernels' dispatch switches anew (`kernels.dispatch.load_switches`): a
    decoder or runner runs with the environment of its load."""
    load_switches()
    int4 = int4_mode(int4)
    path = spec.decoder_path
    st = path.stat()
    key = (
        str(path.resolve()),
        st.st_mtime_ns,
        st.st_size,
        str(dev),
        spec.past_key_names,
        spec.logits_name,
        int4,
        dev.type == "cpu" and envs.read("CPU_PREPACK"),  # products' packed weights (`kernels.cpu_gemm`)
        cpu_gemm.split_parts() if dev.type == "cpu" else 1,  # their column blocks (`kernels.cpu_gemm`)
    )
    prog = _PROGRAMS.get(key)
    if prog is None:
        prog = lower(path, spec, dev, int4)
        _PROGRAMS[key] = prog
    return prog


def pool_pages(
    spec: Any,
    dev: torch.device,
    page_size: int,
    dtype: torch.dtype,
    kv_bytes: int | None,
    pages: int | None = None,
) -> tuple[int, int]:
    """A paged KV pool's size: `(kv_bytes, pages)` for `kv_bytes` (None: `CPU_KV_BYTES` on the CPU,
    `GPU_KV_FRACTION` of the device memory free now on CUDA), at least one page; `pages` given: that many
    (a tensor-parallel rank's pool, sized by rank 0), and their bytes. Logs a warning when the pool holds less
    than one full context."""
    per_page = page_bytes(spec.num_layers, page_size, spec.num_kv_heads, spec.head_size, dtype.itemsize)
    if pages is not None:
        return pages * per_page, pages
    if kv_bytes is None:
        if dev.type == "cuda":  # pragma: cuda
            free, _total = torch.cuda.mem_get_info(dev)
            kv_bytes = int(free * GPU_KV_FRACTION)
        else:
            kv_bytes = CPU_KV_BYTES
    pages = max(int(kv_bytes) // per_page, 1)
    if pages * page_size < spec.context_length:
        log.warning(
            "the KV pool holds %d tokens, less than one full context (%d)",
            pages * page_size,
            spec.context_length,
        )
    return int(kv_bytes), pages


def input_dtype(spec: Any, name: str | None, default: torch.dtype) -> torch.dtype:
    if not name:
        return default
    for io in spec.inputs:
        if io.name == name:
            return {"int32": torch.int32, "int64": torch.int64}.get(io.dtype, default)
    return default
