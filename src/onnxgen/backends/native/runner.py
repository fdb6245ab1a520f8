"""The batched native runner: the lowered program over a flattened ragged batch and a paged KV pool.

    runner = NativeRunner(spec, "cuda")             # the pool is allocated once, here
    logits = runner.run(BatchStep(...))              # [R, vocab] float32: one row per chunk that asks

A step's tokens run as one sequence of T positions (`[1, T]` through every per-token op: embeddings,
norms, projections, MLPs); the attention ops see the step's `PagedStep` (`RunCtx.paged`) and attend each
token over its own sequence's pages only; the lm_head sees only the rows whose logits are wanted. The
program is shared with the batch-1 `NativeDecoder`s of the package (one copy of the weights).

On CUDA, a step of decodes only (one token per sequence) replays a CUDA graph captured for its batch size
padded up to a bucket (`GRAPH_BATCHES`), with every per-step input in device buffers (token ids,
positions, slots, KV lengths, page tables: one upload each from pinned memory, no synchronisation).
Padding rows write into a scratch page outside the pool and attend to it alone; their logits are
dropped. Prefill chunks and mixed steps run eagerly. A capture that fails turns graphs off for the
runner (logged once) and leaves the process usable.

A package can be batched when every KV-bound node is a fused attention op (GroupQueryAttention, or ai.onnx
Attention without a mask) and the graph needs no attention mask or extra inputs: `batchable(program,
spec)`. Other packages run one request per `NativeDecoder` (the engine decides).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from onnxgen.backends.batch import BatchStep
from onnxgen.backends.native import paged
from onnxgen.backends.native.device import (
    Staging,
    device_lock,
    input_dtype,
    kv_dtype,
    repair_after_failed_capture,
    shared_program,
    torch_device,
)
from onnxgen.backends.native.lowering import Program
from onnxgen.backends.native.ops import RunCtx
from onnxgen.errors import BackendUnavailable, DeviceOutOfMemory, NotCapturable
from onnxgen.kv.storage import PageStorage, page_bytes

log = logging.getLogger(__name__)

PAGE_SIZE = 16
CPU_KV_BYTES = 2 << 30  # default pool on the CPU: 2 GiB of address space (pages are touched when written)
GPU_KV_FRACTION = 0.8  # default pool on CUDA: this fraction of the device memory free after the weights
GRAPH_BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def batchable(program: Program, spec: Any) -> str | None:
    """None when the package can run ragged batches over a paged pool, else the reason it cannot."""
    if not program.static_ok:
        return "its attention is not one fused op per layer (KV concatenated in the graph)"
    if program.uses_attention_mask:
        return "the graph reads its attention mask beyond the KV lengths"
    if spec.extra_inputs:
        return f"the graph takes extra inputs ({', '.join(i.name for i in spec.extra_inputs)})"
    return None


@dataclass
class _Graph:
    """A captured decode step for `batch` sequences and the device buffers it reads and writes."""

    batch: int
    graph: Any
    wide: torch.Tensor  # [3, batch] int64: token ids, positions, slots
    narrow: torch.Tensor  # [batch * (1 + max pages)] int32: KV lengths, then the page table rows
    out: torch.Tensor  # the program's logits output [1, batch, vocab]


class NativeRunner:
    """`BatchRunner` over a lowered ONNX graph (backend "native")."""

    backend = "native"

    def __init__(self, spec: Any, device: str = "cpu", *, page_size: int = PAGE_SIZE, kv_bytes: int | None = None,
                 cuda_graphs: bool = True, max_batch: int = 64) -> None:  # fmt: skip
        """`kv_bytes`: the pool's size in bytes (default: `CPU_KV_BYTES` on the CPU, `GPU_KV_FRACTION` of
        the free device memory on CUDA). `cuda_graphs`: replay decode steps of up to `max_batch` sequences
        from CUDA graphs (captured at load). Raises `BackendUnavailable` when the package cannot be
        batched, `DeviceOutOfMemory` when the pool cannot be allocated."""
        t0 = time.perf_counter()
        self.spec = spec
        self.device = device
        self._dev = torch_device(device)
        dtype = kv_dtype(spec)
        self.program = shared_program(spec, self._dev)
        why = batchable(self.program, spec)
        if why is not None:
            raise BackendUnavailable(f"{spec.path}: cannot batch this package: {why}")
        per_page = page_bytes(spec.num_layers, page_size, spec.num_kv_heads, spec.head_size, dtype.itemsize)
        if kv_bytes is None:
            if self._dev.type == "cuda":
                free, _total = torch.cuda.mem_get_info(self._dev)
                kv_bytes = int(free * GPU_KV_FRACTION)
            else:
                kv_bytes = CPU_KV_BYTES
        num_pages = max(int(kv_bytes) // per_page, 1)
        if num_pages * page_size < spec.context_length:
            log.warning("the KV pool holds %d tokens, less than one full context (%d)", num_pages * page_size,
                        spec.context_length)  # fmt: skip
        try:  # one page more than the pool: the scratch page padding rows of graph steps write into
            self.storage = PageStorage(spec.num_layers, num_pages + 1, page_size, spec.num_kv_heads,
                                       spec.head_size, dtype, self._dev)  # fmt: skip
        except torch.cuda.OutOfMemoryError as exc:
            raise DeviceOutOfMemory(f"cannot allocate a KV pool of {kv_bytes / 2**30:.1f} GiB") from exc
        self.page_size = page_size
        self.num_pages = num_pages
        self._scratch = num_pages
        self._rows = paged.PoolRows(self.storage)
        self.device_lock = device_lock(self._dev)
        self._staging = Staging(self._dev)
        p = self.program
        self._in_ids = p.input_slots.get(spec.input_ids_name, -1)
        self._in_pos = p.input_slots.get(spec.position_ids_name or "", -1)
        self._ids_dtype = input_dtype(spec, spec.input_ids_name, torch.int64)
        self._pos_dtype = input_dtype(spec, spec.position_ids_name, torch.int64)
        self._max_pages = -(-spec.context_length // page_size)
        self._graphs: dict[int, _Graph] = {}
        self._pool: Any = None
        self._graph_batches = [b for b in GRAPH_BATCHES if b <= max_batch] if cuda_graphs and self._dev.type == "cuda" else []
        if max_batch > GRAPH_BATCHES[-1] and self._graph_batches:
            self._graph_batches.append(max_batch)
        self.steps = {"graph": 0, "eager": 0}
        with self.device_lock:
            for b in list(self._graph_batches):
                if not self.cuda_graphs:  # a capture failed: graphs are off
                    break
                self._capture(b)
        self.load_seconds = time.perf_counter() - t0

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs (False after a failed capture, and on the CPU)."""
        return bool(self._graph_batches)

    def kv_bytes(self) -> int:
        return self.storage.nbytes()

    def run(self, step: BatchStep) -> torch.Tensor:
        """Logits `[R, vocab]` (float32, on the device) of the last token of each chunk with `logits`."""
        try:
            with self.device_lock:
                b = len(step.seqs)
                if self._graph_batches and b <= self._graph_batches[-1] and all(len(s.tokens) == 1 for s in step.seqs):
                    return self._run_graph(step)
                return self._run_eager(step)
        except torch.cuda.OutOfMemoryError as exc:
            raise DeviceOutOfMemory(f"the device ran out of memory running a batch of {step.num_tokens} "
                                    "token(s)") from exc  # fmt: skip

    # --- eager -------------------------------------------------------------------------------------

    def _run_eager(self, step: BatchStep) -> torch.Tensor:
        t = step.num_tokens
        ps = paged.build_step(step, self.storage, self.page_size, self._dev)
        env = self.program.new_env()
        ids = torch.tensor([tok for s in step.seqs for tok in s.tokens], dtype=torch.int64)
        env[self._in_ids] = ids.to(self._dev, non_blocking=True).view(1, t).to(self._ids_dtype)
        if self._in_pos >= 0:
            env[self._in_pos] = ps.positions.view(1, t).to(self._pos_dtype)
        out = self.program.execute(env, RunCtx(self._rows, -1, t, ps.positions, last=ps.last, paged=ps))
        self.steps["eager"] += 1
        return out.reshape(-1, out.shape[-1]).float()

    # --- CUDA graphs for decode steps --------------------------------------------------------------

    def _run_graph(self, step: BatchStep) -> torch.Tensor:
        b = len(step.seqs)
        bucket = next(x for x in self._graph_batches if x >= b)
        g = self._graphs[bucket]
        P, pad = self.page_size, bucket - b
        ids, pos, slots, lens, table = [], [], [], [], []
        for s in step.seqs:
            p = s.start
            ids.append(s.tokens[0])
            pos.append(p)
            slots.append(s.pages[p // P] * P + p % P)
            lens.append(p + 1)
            need = p // P + 1
            table.extend(s.pages[:need])
            table.extend([self._scratch] * (self._max_pages - need))
        scratch_slot = self._scratch * P
        wide = torch.tensor([*ids, *[0] * pad, *pos, *[0] * pad, *slots, *[scratch_slot] * pad], dtype=torch.int64)
        narrow = torch.tensor([*lens, *[1] * pad, *table, *[self._scratch] * (pad * self._max_pages)],
                              dtype=torch.int32)  # fmt: skip
        self._staging.upload(wide, g.wide.view(-1))
        self._staging.upload(narrow, g.narrow)
        g.graph.replay()
        self.steps["graph"] += 1
        return g.out.reshape(bucket, -1)[:b].float()

    def _graph_step(self, g: _Graph) -> paged.PagedStep:
        """The attention metadata of a graph's step: views of its device buffers, and host shapes sized for
        any KV length up to the context (so the kernels' split of the keys is fixed at capture)."""
        bucket, mp = g.batch, self._max_pages
        return paged.PagedStep(
            self.storage, self.page_size, positions=g.wide[1], slots=g.wide[2],
            last=torch.arange(bucket, dtype=torch.int64, device=self._dev),
            page_table=g.narrow[bucket:].view(bucket, mp),
            q_starts_t=torch.arange(bucket + 1, dtype=torch.int32, device=self._dev), seq_lens_t=g.narrow[:bucket],
            q_starts=list(range(bucket + 1)), seq_lens=[self.spec.context_length] * bucket,
        )  # fmt: skip

    def _graph_forward(self, g: _Graph, ps: paged.PagedStep) -> torch.Tensor:
        bucket = g.batch
        env = self.program.new_env()
        env[self._in_ids] = g.wide[0].view(1, bucket).to(self._ids_dtype)
        if self._in_pos >= 0:
            env[self._in_pos] = ps.positions.view(1, bucket).to(self._pos_dtype)
        return self.program.execute(env, RunCtx(self._rows, -1, bucket, ps.positions, last=ps.last, paged=ps,
                                                static=True))  # fmt: skip

    def _capture(self, bucket: int) -> None:
        """Capture the decode step for `bucket` sequences (all padding: harmless to run). On failure turn
        graphs off for this runner and repair what a broken capture leaves behind."""
        mp = self._max_pages
        wide = torch.zeros((3, bucket), dtype=torch.int64, device=self._dev)
        wide[2].fill_(self._scratch * self.page_size)
        narrow = torch.full((bucket * (1 + mp),), self._scratch, dtype=torch.int32, device=self._dev)
        narrow[:bucket].fill_(1)
        g = _Graph(bucket, None, wide, narrow, torch.empty(0))
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            ps = self._graph_step(g)
            with torch.cuda.stream(stream):  # compile and settle the allocator (and the step's work lists)
                self._graph_forward(g, ps)
            torch.cuda.current_stream().wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                g.out = self._graph_forward(g, ps)
            g.graph = graph
            self._graphs[bucket] = g
        except (NotCapturable, RuntimeError) as exc:
            log.warning("CUDA graph capture of a %d-sequence decode step failed (%s: %s); decode steps run "
                        "eagerly", bucket, type(exc).__name__, exc)  # fmt: skip
            self._graph_batches = []
            self._graphs.clear()
            self._pool = None
            repair_after_failed_capture(self._dev)
