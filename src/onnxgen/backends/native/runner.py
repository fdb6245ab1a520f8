"""The batched native runner: the lowered program over a flattened ragged batch and a paged KV pool.

    runner = NativeRunner(spec, "cuda")             # the pool is allocated once, here
    logits = runner.run(BatchStep(...))              # [R, vocab] float32: one row per chunk that asks

A step's tokens run as one sequence of T positions (`[1, T]` through every per-token op: embeddings,
norms, projections, MLPs); the attention ops see the step's `PagedStep` (`RunCtx.paged`) and attend each
token over its own sequence's pages only; the lm_head sees only the rows whose logits are wanted. The
program is shared with the batch-1 `NativeDecoder`s of the package (one copy of the weights).

A package can be batched when every KV-bound node is a fused attention op (GroupQueryAttention, or ai.onnx
Attention without a mask) and the graph needs no attention mask or extra inputs: `batchable(program,
spec)`. Other packages run one request per `NativeDecoder` (the engine decides).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from onnxgen.backends.batch import BatchStep
from onnxgen.backends.native import paged
from onnxgen.backends.native.decoder import _KV_DTYPES, _shared_program, device_lock
from onnxgen.backends.native.lowering import Program
from onnxgen.backends.native.ops import RunCtx
from onnxgen.errors import BackendUnavailable, DeviceOutOfMemory, InvalidRequest
from onnxgen.kv.storage import PageStorage, page_bytes

log = logging.getLogger(__name__)

PAGE_SIZE = 16
CPU_KV_BYTES = 2 << 30  # default pool on the CPU: 2 GiB of address space (pages are touched when written)
GPU_KV_FRACTION = 0.8  # default pool on CUDA: this fraction of the device memory free after the weights


def batchable(program: Program, spec: Any) -> str | None:
    """None when the package can run ragged batches over a paged pool, else the reason it cannot."""
    if not program.static_ok:
        return "its attention is not one fused op per layer (KV concatenated in the graph)"
    if program.uses_attention_mask:
        return "the graph reads its attention mask beyond the KV lengths"
    if spec.extra_inputs:
        return f"the graph takes extra inputs ({', '.join(i.name for i in spec.extra_inputs)})"
    return None


class NativeRunner:
    """`BatchRunner` over a lowered ONNX graph (backend "native")."""

    backend = "native"

    def __init__(self, spec: Any, device: str = "cpu", *, page_size: int = PAGE_SIZE,
                 kv_bytes: int | None = None, kv_fraction: float = GPU_KV_FRACTION) -> None:  # fmt: skip
        """`kv_bytes`: the pool's size in bytes (default: `CPU_KV_BYTES` on the CPU, `kv_fraction` of the
        free device memory on CUDA). Raises `BackendUnavailable` when the package cannot be batched."""
        t0 = time.perf_counter()
        if device not in ("cpu", "cuda"):
            raise InvalidRequest(f"unknown device {device!r}; choose cpu or cuda", field="device")
        if device == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailable("device='cuda' but torch sees no CUDA device; use device='cpu'")
        if spec.kv_dtype not in _KV_DTYPES:
            raise BackendUnavailable(f"the native backend does not support KV dtype {spec.kv_dtype!r}")
        self.spec = spec
        self.device = device
        self._dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        self.program = _shared_program(spec, self._dev)
        why = batchable(self.program, spec)
        if why is not None:
            raise BackendUnavailable(f"{spec.path}: cannot batch this package: {why}")
        dtype = _KV_DTYPES[spec.kv_dtype]
        per_page = page_bytes(spec.num_layers, page_size, spec.num_kv_heads, spec.head_size, dtype.itemsize)
        if kv_bytes is None:
            if self._dev.type == "cuda":
                free, _total = torch.cuda.mem_get_info(self._dev)
                kv_bytes = int(free * kv_fraction)
            else:
                kv_bytes = CPU_KV_BYTES
        num_pages = max(int(kv_bytes) // per_page, 1)
        if num_pages * page_size < spec.context_length:
            log.warning("the KV pool holds %d tokens, less than one full context (%d)", num_pages * page_size,
                        spec.context_length)  # fmt: skip
        try:
            self.storage = PageStorage(spec.num_layers, num_pages, page_size, spec.num_kv_heads, spec.head_size,
                                       dtype, self._dev)  # fmt: skip
        except torch.cuda.OutOfMemoryError as exc:
            raise DeviceOutOfMemory(f"cannot allocate a KV pool of {kv_bytes / 2**30:.1f} GiB") from exc
        self.page_size = page_size
        self.num_pages = num_pages
        self._rows = paged.PoolRows(self.storage)
        self.device_lock = device_lock(self._dev)
        p = self.program
        self._in_ids = p.input_slots.get(spec.input_ids_name, -1)
        self._in_pos = p.input_slots.get(spec.position_ids_name or "", -1)
        self._ids_dtype = _input_dtype(spec, spec.input_ids_name)
        self._pos_dtype = _input_dtype(spec, spec.position_ids_name)
        self.load_seconds = time.perf_counter() - t0

    def run(self, step: BatchStep) -> torch.Tensor:
        """Logits `[R, vocab]` (float32, on the device) of the last token of each chunk with `logits`."""
        t = step.num_tokens
        try:
            with self.device_lock:
                ps = paged.build_step(step, self.storage, self.page_size, self._dev)
                env = self.program.new_env()
                ids = torch.tensor([tok for s in step.seqs for tok in s.tokens], dtype=torch.int64)
                env[self._in_ids] = ids.to(self._dev, non_blocking=True).view(1, t).to(self._ids_dtype)
                if self._in_pos >= 0:
                    env[self._in_pos] = ps.positions.view(1, t).to(self._pos_dtype)
                ctx = RunCtx(self._rows, -1, t, ps.positions, last=ps.last, paged=ps)
                out = self.program.execute(env, ctx)
        except torch.cuda.OutOfMemoryError as exc:
            raise DeviceOutOfMemory(f"the device ran out of memory running a batch of {t} token(s)") from exc
        return out.reshape(-1, out.shape[-1]).float()

    def kv_bytes(self) -> int:
        return self.storage.nbytes()


def _input_dtype(spec: Any, name: str | None) -> torch.dtype:
    for io in spec.inputs:
        if name and io.name == name:
            return {"int32": torch.int32, "int64": torch.int64}.get(io.dtype, torch.int64)
    return torch.int64
