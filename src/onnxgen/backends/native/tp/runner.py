"""`TPRunner`: the batched runner contract (`backends/batch.BatchRunner`) over a tensor-parallel group, on rank
0 (the workers' side of each call: `RunnerTwin`).

Every rank holds a `NativeRunner` over its sharded program and a paged pool of its heads' KV, all pools of
the same pages (`pool_size`, decided by rank 0). Rank 0's engine runs unchanged: its scheduler plans each
step and its `PagedKV` allocates, shares and evicts the pages, so a step (`BatchStep`: tokens, positions,
page tables) is sent to every worker as it is and run there on the worker's pool, the collectives inside
the sharded program meeting; the logits are rank 0's (the vocab-parallel lm_head's slices gathered). A run of decode steps
(`launch_decodes`) is one call: rank 0 chooses each step's tokens (the requests' sampling) and broadcasts
them over the group (`Comm.broadcast`); each worker feeds them to its next step. The pool operations the
engine makes itself go through `TPStorage`: a partly shared page's copy on every rank; a saved context's
KV gathered from every rank's heads, or written to them.

Steps run eagerly on every rank (no CUDA graphs yet: they would have to capture the collectives); the host
KV tier is refused (`engine/executors`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from onnxgen.backends.batch import BatchStep, DeviceTokens
from onnxgen.backends.native.device import kv_dtype, pool_pages, torch_device
from onnxgen.backends.native.runner import PAGE_SIZE, NativeRunner
from onnxgen.backends.native.runs import DecodeRun
from onnxgen.backends.native.tp.comm import Comm
from onnxgen.backends.native.tp.shard import head_split
from onnxgen.backends.native.tp.twins import check_batchable
from onnxgen.backends.native.tp.workers import Group, rank_program


def splits(spec: Any, world: int) -> list[tuple[int, int, int, int]]:
    """Each rank's `head_split`: query heads `[qa, qb)`, KV heads `[ka, kb)` of the whole model."""
    out = []
    for rank in range(world):
        split = head_split(spec.num_heads, spec.num_kv_heads, rank, world)
        assert split is not None, "the sharding pass checked the heads"
        out.append(split)
    return out


def pool_size(spec: Any, device: str, world: int, options: dict[str, Any]) -> int:
    """The pages of every rank's pool: as many as `kv_bytes` (`device.pool_pages`'s default: a share of rank 0's
    free device memory) holds for the rank holding the most KV heads, so no rank's pool exceeds it."""
    qa, qb, ka, kb = max(splits(spec, world), key=lambda s: s[3] - s[2])
    part = dataclasses.replace(spec, num_heads=qb - qa, num_kv_heads=kb - ka)
    page_size = options.get("page_size", PAGE_SIZE)
    return pool_pages(part, torch_device(device), page_size, kv_dtype(spec), options.get("kv_bytes"))[1]


class TPRunner:
    """A `NativeRunner` whose every layer runs on `world` ranks (backend "native", option `tensor_parallel`)."""

    backend = "native"
    cuda_graphs = False

    def __init__(self, group: Group, comm: Comm, local: NativeRunner) -> None:
        self._group, self._comm, self.local = group, comm, local
        self.device = local.device
        self.page_size, self.num_pages = local.page_size, local.num_pages
        self.rope_switch, self.kv_window = local.rope_switch, local.kv_window
        heads = [(ka, kb) for _, _, ka, kb in splits(group.launch.spec, group.world)]
        self.storage = TPStorage(group, local.storage, heads)

    @staticmethod
    def start(spec: Any, device: str, tensor_parallel: int, *, max_batch: int, **options: Any) -> TPRunner:
        """Start a group of `tensor_parallel` ranks (this process is rank 0), each with a runner of `options`
        (`RUNNER_OPTIONS`; CUDA graphs off) over its pool. Raises `UnsupportedSharding` for a graph the pass
        cannot shard, `BackendUnavailable` for a package that cannot be batched, and what loading a
        `NativeRunner` raises."""
        opts = {**options, "cuda_graphs": False}
        group, comm = Group.start(spec, device, opts, tensor_parallel, runner={"max_batch": max_batch})
        try:
            program, local_spec = rank_program(group.launch, 0, comm)
            check_batchable(program, local_spec)
            group.wait("lowered")
            comm.connect(group.launch.store)
            pages = pool_size(spec, device, tensor_parallel, options)
            group.send("pages", pages)
            local = NativeRunner(
                local_spec, device, max_batch=max_batch, **opts, _program=program, _pages=pages
            )
            group.wait("ready")
        except BaseException:
            group.stop("loading failed")
            raise
        return TPRunner(group, comm, local)

    @property
    def verify_sizes(self) -> tuple[int, ...]:
        return self.local.verify_sizes

    def kv_bytes(self) -> int:
        """Rank 0's part of the pool (each rank holds its heads')."""
        return self.local.kv_bytes()

    def run(self, step: BatchStep) -> torch.Tensor:
        """`BatchRunner.run` on every rank: rank 0's logits."""
        return self._group.call(("run", step), lambda: self.local.run(step))[0]

    def launch_decodes(
        self, step: BatchStep, k: int, choose: Any, offset: int = 0, after: DeviceTokens | None = None
    ) -> DecodeRun:
        """`BatchRunner.launch_decodes` on every rank: rank 0 chooses each step's tokens and broadcasts them (and
        first `after`'s last tokens, this run's first ids)."""
        comm = self._comm
        first = after.toks[-1] if after is not None else None

        def sent(logits: torch.Tensor, j: int) -> torch.Tensor:
            return comm.broadcast(choose(logits, j).to(torch.int64).contiguous())

        def mine() -> DecodeRun:
            if first is not None:
                comm.broadcast(first.to(torch.int64).contiguous())
            return self.local.launch_decodes(step, k, sent, offset, after)

        return self._group.call(("decodes", step, k, offset, first is not None), mine)[0]

    def stage_tokens(self, toks: torch.Tensor) -> DecodeRun:
        return self.local.stage_tokens(toks)

    def decode_parts(self, run: DecodeRun) -> tuple[int, ...]:
        return self.local.decode_parts(run)

    def collect_decodes(self, run: DecodeRun, rows: int | None = None) -> list[list[int]]:
        return self.local.collect_decodes(run, rows)

    def shutdown(self) -> None:
        """Stop the workers (idempotent): the model is closed; a later step raises `BackendUnavailable`."""
        self._group.stop()

    @property
    def workers(self) -> list[Any]:
        """The worker processes still running (tests, diagnostics)."""
        return self._group.alive


class TPStorage:
    """The engine's view of the pools (`kv.storage.PageStorage`'s calls it makes): rank 0's pool for what is
    read locally (`data`: its dtype and device), each change made on every rank, a gather of every rank's
    heads. `heads`: each rank's KV heads `[ka, kb)` of the whole cache (`splits`)."""

    def __init__(self, group: Group, local: Any, heads: list[tuple[int, int]]) -> None:
        self._group, self.local, self._heads = group, local, heads
        self.num_layers, self.num_pages, self.page_size = local.num_layers, local.num_pages, local.page_size
        self.head_dim = local.head_dim
        self.kv_heads = max(b for _, b in heads)
        self.data = local.data

    @property
    def dtype(self) -> Any:
        return self.local.dtype

    @property
    def device(self) -> Any:
        return self.local.device

    def nbytes(self) -> int:
        """Rank 0's pool."""
        return self.local.nbytes()

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """`PageStorage.copy_prefix` on every rank."""
        self._group.call(("copy_prefix", src, dst, n), lambda: self.local.copy_prefix(src, dst, n))

    def write(self, layer: int, slots: Any, k: Any, v: Any) -> None:
        """`PageStorage.write` of the whole cache's heads (`[T, kv_heads, head_dim]`): each rank its own."""
        host = slots.cpu()
        calls = [("write", layer, host, k[:, a:b].cpu(), v[:, a:b].cpu()) for a, b in self._heads[1:]]
        a, b = self._heads[0]
        self._group.call(("write",), lambda: self.local.write(layer, slots, k[:, a:b], v[:, a:b]), calls)

    def gather(self, layer: int, pages: Any, length: int) -> tuple[Any, Any]:
        """`PageStorage.gather` of every rank's heads: the whole cache's `[kv_heads, length, head_dim]`."""
        call = ("gather", layer, pages.cpu(), length)
        mine, theirs = self._group.call(call, lambda: self.local.gather(layer, pages, length))
        parts: dict[int, tuple[Any, Any]] = {}
        for rank, kv in enumerate([mine, *theirs]):
            parts.setdefault(self._heads[rank][0], kv)  # replicated KV heads: the first rank's copy
        order = [parts[a] for a in sorted(parts)]
        dev = self.local.device
        return torch.cat([k.to(dev) for k, _ in order]), torch.cat([v.to(dev) for _, v in order])
