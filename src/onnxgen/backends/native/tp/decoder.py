"""`TPDecoder`: the Decoder contract (`backends/base.py`) over a tensor-parallel group, on rank 0 (the workers'
side of each call: `twins.Twins`).

Rank 0's `TPDecoder` wraps a `NativeDecoder` running rank 0's sharded program (its heads' KV); every worker
holds a twin `NativeDecoder` of the same id running its part. A call that changes a cache is sent to the
workers, then run by rank 0 (`workers.Group`'s protocol); the logits come out of rank 0 whole (the lm_head is
replicated). `fork` makes a new decoder on every rank; a collected `TPDecoder`'s twins are dropped with the
next call. `kv_bytes` and `info` describe rank 0's part. `export_kv` gathers every rank's heads into the
whole cache, `import_kv` sends each rank its heads. `shutdown` stops the workers (the model closed): later
calls raise `BackendUnavailable`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from onnxgen.backends.native.decoder import NativeDecoder
from onnxgen.backends.native.tp.shard import head_split
from onnxgen.backends.native.tp.workers import Group, rank_program
from onnxgen.errors import ContextOverflow, InvalidRequest


class TPDecoder:
    """A `NativeDecoder` whose every layer runs on `world` ranks (backend "native", option `tensor_parallel`)."""

    backend = "native"
    can_rewind = True

    def __init__(self, group: Group, local: NativeDecoder, decoder_id: int) -> None:
        self._group, self.local, self._id = group, local, decoder_id
        self.spec = group.launch.spec
        self.device = local.device
        weakref.finalize(self, group.dropped, decoder_id)

    @staticmethod
    def start(spec: Any, device: str, tensor_parallel: int, **options: Any) -> TPDecoder:
        """Start a group of `tensor_parallel` ranks (this process is rank 0) and return its first decoder.
        Raises `UnsupportedSharding` for a graph the pass cannot shard, `InvalidRequest` for an image
        pipeline, and what loading a `NativeDecoder` raises."""
        if spec.multimodal is not None or spec.inputs_embeds_name:
            raise InvalidRequest(
                "tensor_parallel does not run image pipelines yet; load with tensor_parallel=1",
                field="tensor_parallel",
            )
        group, comm = Group.start(spec, device, options, tensor_parallel)
        try:
            program, local_spec = rank_program(group.launch, 0, comm)
            group.wait("lowered")
            comm.connect(group.launch.store)
            local = NativeDecoder(local_spec, device, **options, _program=program)
            group.wait("ready")
        except BaseException:
            group.stop("loading failed")
            raise
        return TPDecoder(group, local, 0)

    def _call(
        self, call: tuple[Any, ...], mine: Callable[[], Any], per_rank: list[tuple[Any, ...]] | None = None
    ) -> tuple[Any, list[Any]]:
        return self._group.call(call, mine, per_rank)

    # --- the seam ----------------------------------------------------------------------------------

    def kv_len(self) -> int:
        return self.local.kv_len()

    def rewind_to(self, n: int) -> bool:
        assert 0 <= n <= self.local.kv_len(), f"rewind_to({n}) outside [0, {self.local.kv_len()}]"
        return bool(self._call(("rewind", self._id, n), lambda: self.local.rewind_to(n))[0])

    def reset(self) -> None:
        self._call(("reset", self._id), self.local.reset)

    # --- running -----------------------------------------------------------------------------------

    def forward(
        self, tokens: Sequence[int], start_pos: int, inputs: Mapping[str, Any] | None = None, rows: int = 1
    ) -> torch.Tensor:
        assert start_pos == self.local.kv_len(), f"start_pos {start_pos} != kv_len {self.local.kv_len()}"
        total = start_pos + len(tokens)
        if total > self.spec.context_length:
            raise ContextOverflow(total, self.spec.context_length)
        sent = None if inputs is None else {k: _host(v) for k, v in inputs.items()}
        call = ("forward", self._id, [int(t) for t in tokens], start_pos, sent, rows)
        return self._call(call, lambda: self.local.forward(tokens, start_pos, inputs, rows))[0]

    # --- memory and lifetime -----------------------------------------------------------------------

    def kv_bytes(self) -> int:
        """Rank 0's part of the cache (each rank holds its heads')."""
        return self.local.kv_bytes()

    @property
    def info(self) -> dict[str, Any]:
        return {**self.local.info, "tensor_parallel": self._group.world}

    def export_kv(self) -> list[tuple[Any, Any]]:
        """Every rank's heads gathered into the whole cache, per layer `[kv_heads, n, head_size]`."""
        mine, theirs = self._call(("export", self._id), self.local.export_kv)
        parts: dict[int, list[tuple[Any, Any]]] = {}
        for rank, layers in enumerate([mine, *theirs]):
            parts.setdefault(self._heads(rank)[0], layers)  # replicated KV heads: the first rank's copy
        order = [parts[k] for k in sorted(parts)]
        return [
            (np.concatenate([p[i][0] for p in order]), np.concatenate([p[i][1] for p in order]))
            for i in range(len(mine))
        ]

    def import_kv(self, tokens: Sequence[int], layers: Sequence[tuple[Any, Any]]) -> None:
        """Each rank gets its heads of `layers`."""

        def part(rank: int) -> list[tuple[Any, Any]]:
            a, b = self._heads(rank)
            return [(k[a:b], v[a:b]) for k, v in layers]

        toks = [int(t) for t in tokens]
        calls = [("import", self._id, toks, part(r)) for r in range(1, self._group.world)]
        self._call(("import", self._id), lambda: self.local.import_kv(tokens, part(0)), per_rank=calls)

    def _heads(self, rank: int) -> tuple[int, int]:
        split = head_split(self.spec.num_heads, self.spec.num_kv_heads, rank, self._group.world)
        assert split is not None, "the sharding pass checked the heads"
        return split[2], split[3]

    def close(self) -> None:
        """Free the cache on every rank (the workers keep running; `shutdown` stops them)."""
        if self._group.broken is not None:
            self.local.close()
            return
        self._call(("close", self._id), self.local.close)

    def fork(self) -> TPDecoder:
        new = self._group.new_id()
        local, _ = self._call(("fork", self._id, new), self.local.fork)
        return TPDecoder(self._group, local, new)

    def shutdown(self) -> None:
        """Stop the workers (idempotent): the model is closed; a later call raises `BackendUnavailable`."""
        self._group.stop()

    @property
    def workers(self) -> list[Any]:
        """The worker processes still running (tests, diagnostics)."""
        return self._group.alive


def _host(v: Any) -> Any:
    return v.detach().cpu() if isinstance(v, torch.Tensor) else v
