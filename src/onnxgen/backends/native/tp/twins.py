"""A worker's side of rank 0's calls (`tp.workers`): `Twins` (its decoders, by the id rank 0 gave them:
`tp.decoder`) or `RunnerTwin` (its paged runner over its pool: `tp.runner`). Each `run`s one call as rank 0
runs it, so the collectives inside the sharded program meet; `check_batchable` is the runner's check every
rank makes before joining the group."""

from __future__ import annotations

from typing import Any

import torch

from onnxgen.backends.batch import DeviceTokens
from onnxgen.backends.native.batching import batchable
from onnxgen.backends.native.decoder import NativeDecoder
from onnxgen.backends.native.runner import NativeRunner
from onnxgen.errors import BackendUnavailable


class Twins:
    """A worker's decoders, by the id rank 0 gave them; `run` applies one of rank 0's calls."""

    def __init__(self, spec: Any, device: str, options: dict[str, Any], program: Any) -> None:
        self._decoders: dict[int, NativeDecoder] = {
            0: NativeDecoder(spec, device, **options, _program=program)
        }

    def drop(self, decoder_id: int) -> None:
        d = self._decoders.pop(decoder_id, None)
        if d is not None:
            d.close()

    def run(self, call: tuple[Any, ...]) -> Any:
        kind, i, *args = call
        d = self._decoders[i]
        if kind == "forward":
            tokens, start, inputs, rows = args
            d.forward(tokens, start, inputs, rows)
            return None
        if kind == "fork":
            self._decoders[args[0]] = d.fork()
        elif kind == "rewind":
            return d.rewind_to(args[0])
        elif kind == "reset":
            d.reset()
        elif kind == "close":
            d.close()
        elif kind == "export":
            return d.export_kv()
        elif kind == "import":
            d.import_kv(args[0], args[1])
        else:
            raise AssertionError(f"unknown call {kind!r}")
        return None


class RunnerTwin:
    """A worker's runner over its pool of `pages` pages; `run` applies one of rank 0's calls."""

    def __init__(
        self, spec: Any, device: str, options: dict[str, Any], program: Any, comm: Any, pages: int
    ) -> None:
        """`options`: the runner's (`RUNNER_OPTIONS` and `max_batch`); `comm`: the group (`tp.comm.Comm`)."""
        self.runner = NativeRunner(spec, device, **options, _program=program, _pages=pages)
        self._comm = comm

    def drop(self, decoder_id: int) -> None:
        """No decoders here (the group's decoder protocol only)."""

    def run(self, call: tuple[Any, ...]) -> Any:
        kind, *args = call
        r, st = self.runner, self.runner.storage
        dev = st.device
        if kind == "run":
            r.run(args[0])
        elif kind == "decodes":
            step, k, offset, has_first = args
            b = len(step.seqs)

            def received(logits: torch.Tensor, j: int) -> torch.Tensor:
                return self._comm.broadcast(torch.empty(b, dtype=torch.int64, device=dev))

            first = None
            if has_first:
                first = DeviceTokens(
                    self._comm.broadcast(torch.empty(b, dtype=torch.int64, device=dev)).view(1, b)
                )
            r.launch_decodes(step, k, received, offset, first)
        elif kind == "copy_prefix":
            st.copy_prefix(*args)
        elif kind == "write":
            layer, slots, k, v = args
            st.write(layer, slots.to(dev), k.to(dev, st.dtype), v.to(dev, st.dtype))
        elif kind == "gather":
            layer, pages, n = args
            k, v = st.gather(layer, pages.to(dev), n)
            return k.cpu(), v.cpu()
        else:
            raise AssertionError(f"unknown call {kind!r}")
        return None


def check_batchable(program: Any, spec: Any) -> None:
    """Raise `BackendUnavailable` when a rank's program cannot run batched (`batching.batchable`): every rank
    checks before joining the group, so none waits on it."""
    why = batchable(program, spec)
    if why is not None:
        raise BackendUnavailable(f"{spec.path}: cannot batch this package: {why}")
