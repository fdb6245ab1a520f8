"""Session files straight to a device: a `kv.files.Sink` that copies each piece of a file to device memory
while the next pieces are read, through a small ring of pinned host buffers.

    reader threads:  pread piece i into a free pinned slot -> hash it -> copy it to device[offset] (async, on
                     the ring's copy stream) -> the slot goes back, free again once its copy has run
    after the read:  the copies are waited for; the pieces form the data section on the device

The ring (`PinnedRing`) is allocated once per pool (pinning memory is slow) and reused by every restore; the
device copy of the data section is allocated per restore and dropped with it, whatever the checksum says:
nothing reaches the pool before `kv.files.read_session` has checked the whole file.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from onnxgen.kv.files import DTYPES

DEFAULT_SLOTS = 16  # pinned pieces in flight at once (twice `kv.files.READERS`)
MAX_PIECE = 64 << 20  # a file of larger pieces is read into host memory (the ring would pin too much)

_TORCH_DTYPES = {code: name for name, (code, _) in DTYPES.items()}  # safetensors code -> torch dtype name


class PinnedRing:
    """`slots` pinned host buffers of `chunk` bytes each and the stream their device copies run on."""

    def __init__(self, device: Any, chunk: int, slots: int = DEFAULT_SLOTS) -> None:
        import torch

        self.device, self.chunk = torch.device(device), chunk
        self.stream = torch.cuda.Stream(device=self.device)
        self._free: queue.Queue[int] = queue.Queue()
        self._host = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        self._arrays = [h.numpy() for h in self._host]
        self._done: list[Any] = [None] * slots  # the event after each slot's last copy
        for i in range(slots):
            self._free.put(i)

    def take(self) -> int:
        """A free slot (blocks until one is), its last copy finished."""
        i = self._free.get()
        if self._done[i] is not None:
            self._done[i].synchronize()
            self._done[i] = None
        return i

    def give(self, i: int, event: Any) -> None:
        """Slot `i` back, free once `event` (its copy) has run."""
        self._done[i] = event
        self._free.put(i)


class DeviceSink:
    """One restore's data section on the ring's device (`kv.files.Sink`): tensors are views of it."""

    def __init__(self, ring: PinnedRing, nbytes: int) -> None:
        import torch

        self.ring = ring
        self.data = torch.empty(nbytes, dtype=torch.uint8, device=ring.device)
        self._lock = threading.Lock()
        self._slots: dict[int, int] = {}

    def buffer(self, offset: int, n: int) -> memoryview:
        assert n <= self.ring.chunk, (n, self.ring.chunk)
        i = self.ring.take()
        with self._lock:
            self._slots[offset] = i
        return memoryview(self.ring._arrays[i][:n])

    def filled(self, offset: int, buf: memoryview) -> None:
        import torch

        with self._lock:
            i = self._slots.pop(offset)
        n = len(buf)
        with torch.cuda.stream(self.ring.stream):
            self.data[offset : offset + n].copy_(self.ring._host[i][:n], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.ring.stream)
        self.ring.give(i, event)

    def finish(self) -> Any:
        self.ring.stream.synchronize()
        return self.data

    def tensor(self, data: Any, dtype: str, dims: tuple[int, ...], start: int, end: int) -> Any:
        import torch

        return data[start:end].view(getattr(torch, _TORCH_DTYPES[dtype])).view(dims)


class DeviceStaging:
    """What a paged pool on a CUDA device gives `read_session` as its `sink`: a `DeviceSink` per restore over
    one `PinnedRing` (made on first use, remade for a file of larger pieces), or None (read into host
    memory) when the device cannot hold the file's data beside the pool or its pieces exceed `MAX_PIECE`."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self._ring: PinnedRing | None = None
        self._lock = threading.Lock()

    def __call__(self, nbytes: int, chunk: int) -> DeviceSink | None:
        import torch

        if chunk > MAX_PIECE:
            return None
        with self._lock:
            if self._ring is None or self._ring.chunk < chunk:
                self._ring = PinnedRing(self.device, chunk)
            ring = self._ring
        try:
            return DeviceSink(ring, nbytes)
        except torch.cuda.OutOfMemoryError:
            return None
