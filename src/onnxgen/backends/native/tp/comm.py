"""A tensor-parallel group's process group, as the lowered collectives (`AllReduce`, `AllGather`) call it:
gloo on the CPU, NCCL on CUDA. Each group is a process group of its own over a `FileStore` in a temporary folder (no global
`torch.distributed` state, no port to pick), so one process may hold several tensor-parallel models."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

import onnxgen.envs as envs

# how long a collective (or the group's rendezvous) waits for the other ranks
TIMEOUT_S = 300.0


class Comm:
    """Rank `rank` of `world`. Built before the lowering (its collective nodes hold it); `connect` joins the
    group once every rank has lowered its program."""

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank, self.world, self.device = rank, world, device
        self._pg: dist.ProcessGroup | None = None

    def connect(self, store_path: str, timeout_s: float = TIMEOUT_S) -> None:
        """Join the group (blocks until every rank has joined). On CUDA, NVLink multicast is turned off in this
        process first (`envs.MULTICAST_OFF`)."""
        store = dist.FileStore(store_path, self.world)
        timeout = timedelta(seconds=timeout_s)
        if self.device.type == "cuda":  # pragma: cuda-begin
            envs.set_in_process(envs.MULTICAST_OFF)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(store, self.rank, self.world, opts)
            # pragma: cuda-end
        else:
            self._pg = dist.ProcessGroupGloo(store, self.rank, self.world, timeout)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the ranks, in place."""
        assert self._pg is not None, "the tensor-parallel group is not connected"
        self._pg.allreduce([t]).wait()
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` (the same shape and dtype on every rank), stacked in rank order: `[world, *shape]`
        on every rank."""
        assert self._pg is not None, "the tensor-parallel group is not connected"
        out = torch.empty((self.world, *t.shape), dtype=t.dtype, device=t.device)
        self._pg.allgather([list(out.unbind(0))], [t.contiguous()]).wait()
        return out

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """`t` as rank 0 holds it, on every rank, in place (the paged runner's chosen token ids)."""
        assert self._pg is not None, "the tensor-parallel group is not connected"
        self._pg.broadcast(t, 0).wait()
        return t

    def close(self) -> None:
        self._pg = None
