"""Streaming initializers into one external data file (`model.onnx.data`): values are produced in a
thread pool, written in order at 64-byte aligned offsets, and never all held in memory."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from onnxgen.convert.synthetic.arrays import to_bytes
from onnxgen.convert.synthetic.graph import Initializer
from onnxgen.errors import ConversionError

_ALIGN = 64
_ITEMSIZE = {1: 4, 10: 2, 16: 2, 2: 1}  # onnx TensorProto type -> bytes per element


def stream_initializers(inits: list[Initializer], data_path: Path, progress: bool, workers: int) -> list[Any]:
    """Produce every initializer (in a pool of `workers` threads, written in order) into `data_path`
    (overwritten); return TensorProtos pointing at it. At most ~2*workers tensors are alive at once.

    `progress`: a status line on stdout as tensors are written. Raises ConversionError if a produced
    value has the wrong size (an internal error).
    """
    from onnx import TensorProto

    protos: list[Any] = []
    t0 = time.time()
    total = sum(math.prod(i.shape) for i in inits)
    done = 0

    def job(spec: Initializer) -> memoryview | bytes:
        return to_bytes(spec.produce(), spec.dtype)

    with open(data_path, "wb") as f, ThreadPoolExecutor(max_workers=workers) as pool:
        pending: deque[tuple[Initializer, Future[Any]]] = deque()
        it: Iterator[Initializer] = iter(inits)
        exhausted = False
        offset = 0
        while True:
            while not exhausted and len(pending) < 2 * workers:
                nxt = next(it, None)
                if nxt is None:
                    exhausted = True
                else:
                    pending.append((nxt, pool.submit(job, nxt)))
            if not pending:
                break
            spec, fut = pending.popleft()
            data = fut.result()
            want = math.prod(spec.shape) * _ITEMSIZE[spec.elem]
            if len(data) != want:
                raise ConversionError(
                    f"internal: initializer {spec.name} has {len(data)} bytes, expected {want}"
                )
            if offset % _ALIGN:
                f.write(b"\0" * (_ALIGN - offset % _ALIGN))
                offset += _ALIGN - offset % _ALIGN
            f.write(data)
            t = TensorProto()
            t.name = spec.name
            t.data_type = spec.elem
            t.dims.extend(spec.shape)
            t.data_location = TensorProto.EXTERNAL
            for key, val in (
                ("location", data_path.name),
                ("offset", str(offset)),
                ("length", str(len(data))),
            ):
                e = t.external_data.add()
                e.key, e.value = key, val
            offset += len(data)
            protos.append(t)
            done += math.prod(spec.shape)
            del data
            if progress:
                el = time.time() - t0
                print(
                    f"\r[synthetic] {done / total:6.1%} {offset / 2**30:7.2f} GiB {el:6.1f}s  {spec.name[:60]:<60}",
                    end="",
                    flush=True,
                )
    if progress:
        print()
    return protos
