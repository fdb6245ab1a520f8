"""The host tier of the paged pool: pages that leave the device kept in host memory under their key, and
copied back into the pool instead of recomputed.

    key(page)  = blake2b(key(parent) + the page's tokens)   key(root) = the identity digest (salt, regime)
                 (`PrefixIndex.key`, `page_key`): the same tokens under another identity never share a key

    save(keys, pages)      the index evicts full pages: each copied out before the pool reuses it (a key
                           already held is only marked used: a page's KV never changes, one copy is enough)
    backup(keys, pages)    pages a session no longer pins, copied out ahead of any eviction on the copy
                           stream, so that evicting them later copies nothing
    find(keys) -> n        how many of `keys` (leading) the tier holds
    load(keys, pages)      those keys' KV copied into freshly allocated device pages; returns the copy's
                           event (None: done) that the request needing the pages waits for

Memory: an arena of host slots of one page each (`[layers, 2, page_size, kv_heads, head_dim]` in the pool's
dtype), grown in slabs as pages arrive (pinned on CUDA), never beyond `max_bytes`: at most
`max_bytes // page_bytes` slots ever exist. Least recently used keys give their slots to new ones.

On CUDA every copy runs on one side stream (ordered after the work already queued on the compute stream):
device->host copies at eviction make the compute stream wait for them before the freed pages are written
again (the host never waits); host->device restores are waited for only by the request that needs them
(`engine/paged.py` defers it until its event has completed, and lets the other requests step meanwhile).
On the CPU the same calls copy at once. Not thread-safe: the engine's step owns it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

SLAB_BYTES = 256 << 20  # host memory is allocated (and pinned) this much at a time
CHUNK_BYTES = 64 << 20  # pages copied through one device staging buffer of at most this size


def page_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a page holding `tokens` after the path whose key is `parent`."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


@dataclass
class TierCounters:
    """Pages copied out of the device (`saved`; `backed_up` ahead of eviction), pages copied back
    (`restored`), the keys dropped for newer ones (`dropped`)."""

    saved: int = 0
    backed_up: int = 0
    restored: int = 0
    dropped: int = 0


class HostPages:
    """A bounded LRU store of pool pages in host memory (see the module's docstring)."""

    def __init__(self, storage: Any, max_bytes: int) -> None:
        import torch

        data = storage.data  # [layers, 2, pages, page_size, kv_heads, head_dim]
        self.storage = storage
        self.shape = (data.shape[0], data.shape[1], *data.shape[3:])
        self.page_bytes = data[:, :, 0].numel() * data.element_size()
        self.max_bytes = max_bytes
        self.capacity = max_bytes // self.page_bytes  # slots
        self.cuda = data.device.type == "cuda"
        self.per_slab = max(1, SLAB_BYTES // self.page_bytes)
        self.chunk = max(1, CHUNK_BYTES // self.page_bytes)
        self._slabs: list[Any] = []
        self._made = 0  # slots allocated so far
        self._free: list[int] = []
        self._keys: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self._written: dict[int, Any] = {}  # slot -> the event of its last copy in (CUDA)
        self.counters = TierCounters()
        self._stream = None
        if self.cuda:  # pragma: cuda-begin
            self._stream = torch.cuda.Stream(device=data.device)
        # pragma: cuda-end

    # --- bookkeeping ----------------------------------------------------------------------------------

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def nbytes(self) -> int:
        """Bytes of the pages held now (at most `max_bytes`)."""
        return len(self._keys) * self.page_bytes

    @property
    def arena_bytes(self) -> int:
        """Host memory allocated for slots (at most `max_bytes`)."""
        return self._made * self.page_bytes

    def keys(self) -> list[bytes]:
        """The keys held, least recently used first (the order they give their slots up in)."""
        return list(self._keys)

    def find(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` the tier holds (each found one marked recently used)."""
        n = 0
        for k in keys:
            if k not in self._keys:
                break
            self._keys.move_to_end(k)
            n += 1
        return n

    def _slot(self) -> int | None:
        """A free slot: a freed one, a new one (a new slab when the last is full), or the least recently used
        key's. None when the tier holds no slot at all."""
        if self._free:
            return self._free.pop()
        if self._made < self.capacity:
            if self._made == len(self._slabs) * self.per_slab:
                self._grow()
            self._made += 1
            return self._made - 1
        if not self._keys:
            return None
        _, slot = self._keys.popitem(last=False)
        self.counters.dropped += 1
        return slot

    def _grow(self) -> None:
        import torch

        n = min(self.per_slab, self.capacity - len(self._slabs) * self.per_slab)
        self._slabs.append(torch.empty((n, *self.shape), dtype=self.storage.data.dtype, pin_memory=self.cuda))

    def _view(self, slot: int) -> Any:
        return self._slabs[slot // self.per_slab][slot % self.per_slab]

    def _place(self, keys: Sequence[bytes], pages: Sequence[int]) -> tuple[list[int], list[int]]:
        """Slots for the keys not held yet (the held ones marked used): (device pages, slots) to copy out.
        At most `capacity` of them (the last ones: the most recently used)."""
        todo = [(k, p) for k, p in zip(keys, pages, strict=True) if k not in self._keys]
        for k in keys:
            if k in self._keys:
                self._keys.move_to_end(k)
        if len(todo) > self.capacity:
            self.counters.dropped += len(todo) - self.capacity
            todo = todo[len(todo) - self.capacity :]
        out_pages, slots = [], []
        for k, p in todo:
            slot = self._slot()
            if slot is None:
                break
            self._keys[k] = slot
            out_pages.append(p)
            slots.append(slot)
        return out_pages, slots

    def forget(self, keys: Sequence[bytes]) -> None:
        """Drop `keys` (their slots become free)."""
        for k in keys:
            slot = self._keys.pop(k, None)
            if slot is not None:
                self._free.append(slot)

    def clear(self) -> None:
        """Drop every key and free the arena (the model closes)."""
        self.settle()
        self._keys.clear()
        self._written.clear()
        self._free, self._slabs, self._made = [], [], 0

    # --- copies ---------------------------------------------------------------------------------------

    def save(self, keys: Sequence[bytes], pages: Sequence[int]) -> None:
        """The index evicts `pages` (full pages, keyed `keys`): copy those not held yet out before the pool
        hands the pages out again (on CUDA the compute stream waits for the copy, and for a backup of them
        still in flight)."""
        out_pages, slots = self._place(keys, pages)
        events = [self._written.get(self._keys[k]) for k in keys if k in self._keys]
        if out_pages:
            events.append(self._copy_out(out_pages, slots))
            self.counters.saved += len(out_pages)
        if self.cuda:  # pragma: cuda-begin
            import torch

            main = torch.cuda.current_stream(self.storage.data.device)
            for ev in {id(e): e for e in events if e is not None}.values():
                main.wait_event(ev)
        # pragma: cuda-end

    def backup(self, keys: Sequence[bytes], pages: Sequence[int]) -> None:
        """Copy `pages` (full pages the index still holds, keyed `keys`) out ahead of their eviction, on the
        copy stream; nothing waits for it unless the pages are evicted before it is done (`save`)."""
        out_pages, slots = self._place(keys, pages)
        if out_pages:
            self._copy_out(out_pages, slots)
            self.counters.backed_up += len(out_pages)

    def load(self, keys: Sequence[bytes], pages: Sequence[int]) -> Any:
        """Copy the KV of `keys` (held: `find` said so) into device `pages` (allocated for them, written by
        nothing else until this copy is done). Returns the copy's event (None on the CPU: done)."""
        slots = [self._keys[k] for k in keys]
        for k in keys:
            self._keys.move_to_end(k)
        import torch

        data = self.storage.data
        with self._on_side():
            for i, j, run in self._runs(slots):
                buf = torch.empty((j - i, *self.shape), dtype=data.dtype, device=data.device)
                for a, b, first in run:
                    buf[a - i : b - i].copy_(self._slab_rows(first, b - a), non_blocking=self.cuda)
                idx = torch.tensor(pages[i:j], dtype=torch.int64).to(data.device, non_blocking=self.cuda)
                data.index_copy_(2, idx, buf.permute(1, 2, 0, 3, 4, 5))
        self.counters.restored += len(keys)
        return self._event()

    def settle(self) -> None:
        """Wait for every copy queued so far (CUDA; nothing to wait for on the CPU)."""
        if self._stream is not None:  # pragma: cuda-begin
            self._stream.synchronize()
        # pragma: cuda-end

    def _copy_out(self, pages: Sequence[int], slots: Sequence[int]) -> Any:
        import torch

        data = self.storage.data
        with self._on_side():
            for i, j, run in self._runs(slots):
                idx = torch.tensor(pages[i:j], dtype=torch.int64).to(data.device, non_blocking=self.cuda)
                buf = data.index_select(2, idx).permute(2, 0, 1, 3, 4, 5).contiguous()
                for a, b, first in run:
                    self._slab_rows(first, b - a).copy_(buf[a - i : b - i], non_blocking=self.cuda)
        ev = self._event()
        for s in slots:
            self._written[s] = ev
        return ev

    def _slab_rows(self, first: int, n: int) -> Any:
        """Slots [first, first + n) (within one slab) as one `[n, layers, 2, ...]` view."""
        s = first % self.per_slab
        return self._slabs[first // self.per_slab][s : s + n]

    def _runs(self, slots: Sequence[int]) -> Iterator[tuple[int, int, list[tuple[int, int, int]]]]:
        """`slots` in chunks `[i, j)` of at most `chunk` pages, each with its runs of consecutive slots within
        one slab: `(a, b, first slot)` for positions [a, b) of `slots`."""
        for i in range(0, len(slots), self.chunk):
            j = min(i + self.chunk, len(slots))
            runs, a = [], i
            for b in range(i + 1, j + 1):
                if (
                    b == j
                    or slots[b] != slots[b - 1] + 1
                    or slots[b] // self.per_slab != slots[a] // self.per_slab
                ):
                    runs.append((a, b, slots[a]))
                    a = b
            yield i, j, runs

    def _on_side(self) -> Any:
        """The copy stream, ordered after the compute stream's queued work (CUDA); no stream on the CPU."""
        if self._stream is None:
            return nullcontext()
        import torch  # pragma: cuda-begin

        self._stream.wait_stream(torch.cuda.current_stream(self.storage.data.device))
        return torch.cuda.stream(self._stream)
        # pragma: cuda-end

    def _event(self) -> Any:
        if self._stream is None:
            return None
        import torch  # pragma: cuda-begin

        ev = torch.cuda.Event()
        ev.record(self._stream)
        return ev
        # pragma: cuda-end

    def stats(self) -> dict[str, int]:
        c = self.counters
        return {
            "host_pages": len(self._keys),
            "host_pages_bytes": self.nbytes,
            "host_pages_bound": self.max_bytes,
            "host_pages_saved": c.saved,
            "host_pages_backed_up": c.backed_up,
            "host_pages_restored": c.restored,
            "host_pages_dropped": c.dropped,
        }
