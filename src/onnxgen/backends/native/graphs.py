"""CUDA graphs of static-shape steps: the one capture and replay mechanism of the runner and the decoder.

    graphs = Graphs(device)
    g = graphs.capture(GraphKey("decode", batch=8), body, inputs=buffers, depth=4)   # raises on failure
    g.replay()              # the step; g.replay(deep=True): the step `depth` times over in one graph
    graphs.get(key)         # the captured step under a key, or None

A graph's caller owns its static inputs: device tensors the body reads (rewritten before each replay) and any
objects the captured kernels point into; passed as `inputs`, they live exactly as long as the graph. `body()`
runs the step once (its return value is the graph's output, valid until the next replay).

Capture: the body first runs on a side stream (Triton compiles, the caching allocator settles), then is
captured in thread-local mode (work of other threads cannot invalidate it) into the set's shared memory pool
(one pool for graphs that never run at once), or into a pool of its own (`private_pool`: a failure then
leaves the shared pool alone). A capture that raises is repaired (`repair_after_failed_capture`) before its
error propagates; what a failure turns off is the caller's policy (`NativeDecoder`, `NativeRunner`).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class GraphKey:
    """What a captured step is for: its `kind` ("decode", "prefill", "verify": the runner's steps; "step": a
    decoder's), its sequences (`batch`) and positions per sequence (`tokens`), and `kv`: the KV extent it
    was captured for (the decoder's buffer capacity; a runner decode graph's longest KV length, 0: any)."""

    kind: str
    batch: int = 1
    tokens: int = 1
    kv: int = 0


@dataclass
class Captured(Generic[T]):
    """A captured step: its graph, the body's output, its static inputs and, when captured `depth` > 1
    steps deep, a second graph of the body that many times over (same inputs; the outputs of its last
    step)."""

    key: GraphKey
    inputs: T
    graph: Any  # torch.cuda.CUDAGraph
    out: Any
    deep: Any = None  # torch.cuda.CUDAGraph | None
    depth: int = 1

    def replay(self, deep: bool = False) -> None:  # pragma: cuda
        """Replay the step once, or with `deep` its `depth`-step graph."""
        if deep:
            assert self.deep is not None, self.key
            self.deep.replay()
        else:
            self.graph.replay()


class Graphs(Generic[T]):
    """Captured steps by `GraphKey` on one device, sharing a memory pool; keys whose capture failed are
    remembered (`failed`) until `clear`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._by_key: dict[GraphKey, Captured[T]] = {}
        self._failed: set[GraphKey] = set()
        self._pool: Any = None

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self) -> Iterator[GraphKey]:
        return iter(self._by_key)

    def get(self, key: GraphKey) -> Captured[T] | None:
        return self._by_key.get(key)

    def put(self, g: Captured[T]) -> None:
        """Hold `g` under its key (replacing any): what `capture` does with a step it captured."""
        self._by_key[g.key] = g

    def failed(self, key: GraphKey) -> bool:
        """Whether a capture under `key` failed since the last `clear`."""
        return key in self._failed

    def clear(self) -> None:
        """Drop every graph and the shared pool (the next capture starts a new one: a dropped pool's handle
        must not be reused, the caching allocator asserts on it) and forget failures."""
        self._by_key.clear()
        self._failed.clear()
        self._pool = None

    def capture(
        self,
        key: GraphKey,
        body: Callable[[], Any],
        inputs: T,
        *,
        depth: int = 1,
        private_pool: bool = False,
    ) -> Captured[T]:  # pragma: cuda
        """Capture `body` as the step under `key` (replacing any) and return it; with `depth` > 1 also a graph
        of `body` run `depth` times. Raises what the warm-up or the capture raised (the key is then marked
        `failed` and the process's CUDA state repaired)."""
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # compile and settle the allocator
                body()
            torch.cuda.current_stream().wait_stream(stream)
            if private_pool:
                pool = torch.cuda.graph_pool_handle()
            else:
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                pool = self._pool
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                out = body()
            g = Captured(key, inputs, graph, out)
            if depth > 1:
                g.deep, g.depth = torch.cuda.CUDAGraph(), depth
                with torch.cuda.graph(g.deep, pool=pool, capture_error_mode="thread_local"):
                    for _ in range(depth):
                        body()
        except Exception:
            self._failed.add(key)
            repair_after_failed_capture(self.device)
            raise
        self.put(g)
        return g


def repair_after_failed_capture(dev: torch.device) -> None:  # pragma: cuda
    """A capture that raised before `capture_end` completed leaves the default CUDA generator in its
    capture state, and every later random op of the process fails ("Offset increment outside graph
    capture"). A small successful capture runs the generator's capture prologue and epilogue again,
    which resets that state; the error of the broken capture itself is not sticky."""
    try:
        torch.cuda.synchronize(dev)
        g = torch.cuda.CUDAGraph()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                torch.zeros(1, device=dev).add_(1)
        del g
    except Exception as exc:  # pragma: no cover - the device is in a state we cannot mend
        log.error("could not restore the CUDA state after a failed capture: %s", exc)
