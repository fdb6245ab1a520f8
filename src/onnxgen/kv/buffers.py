"""Device KV storage owned by the runtime: one K and one V buffer per layer, in the model's dtype.

Layout per layer: `[1, kv_heads, capacity, head_dim]` ("BNSH", batch 1). New keys and values are
written in place at `[length : length + n]`; `rewind_to(n)` only sets the length (O(1)); capacity
grows in power-of-two buckets (never below `floor`, see `capacity_bucket`) by copying the valid prefix
into new buffers. Nothing is mirrored to the host. This module imports no backend (docs/architecture.md:
`kv/` never imports a backend). Buffers are torch tensors by default (torch imported lazily, so
`import onnxgen.kv` stays light); a backend with its own array type passes `alloc` (the ort backend:
numpy arrays that its OrtValues wrap), and growth is still this one code path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from onnxgen.errors import InvalidRequest


def capacity_bucket(total: int, floor: int, limit: int | None = None) -> int:
    """The KV capacity (in positions) a cache grows to so that it holds `total`: the smallest power of two
    >= max(total, floor), except that it stops at `limit` (the context length) when `total` fits in it.

        floor 256, limit 2000:  total 1 -> 256, 257 -> 512, 1025 -> 2000 (not 2048), 2001 -> 2048
    """
    need = max(int(total), int(floor), 1)
    cap = 1 << (need - 1).bit_length()
    if limit is not None and total <= limit < cap:
        return limit
    return cap


class KVBuffers:
    """Per-layer K/V buffers `[1, kv_heads, capacity, head_dim]` plus the number of valid positions.

    Contract: positions `[0, length)` of every layer hold valid KV; positions at or beyond `length`
    are garbage and never read by attention. `reserve(total)` guarantees `capacity >= total` (growing
    to `capacity_bucket(total, floor, max_capacity)` and preserving the valid prefix); it never shrinks.
    `length` is only changed by `set_length` / `rewind_to` / `reset` (the decoder advances it after a
    forward). `reset()` keeps the buffers; `reset(free=True)` releases them.

    `alloc(shape)` makes one buffer (default: `torch.empty` of `dtype` on `device`); any array type
    with numpy/torch slicing and `nbytes` works. Raises `InvalidRequest` for a floor below 1 (it is
    the user's `kv_floor` option).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: Any,
        device: Any,
        *,
        floor: int = 256,
        max_capacity: int | None = None,
        value_head_dim: int | None = None,
        alloc: Callable[[tuple[int, ...]], Any] | None = None,
    ) -> None:
        if floor < 1:
            raise InvalidRequest(f"kv_floor must be an int >= 1, got {floor!r}", field="kv_floor")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.value_head_dim = value_head_dim or head_dim
        self.dtype = dtype
        self.device = device
        self.floor = floor
        self.max_capacity = max_capacity
        self._alloc = alloc or self._torch_empty
        self.length = 0
        self.capacity = 0
        self.keys: list[Any] = []
        self.values: list[Any] = []
        self.generation = 0  # bumps whenever the buffers are reallocated (CUDA graphs key on it)

    # --- capacity ---------------------------------------------------------------------------

    def reserve(self, total: int) -> bool:
        """Make room for `total` positions; return True when the buffers were reallocated.

        If an allocation fails (out of memory) the buffers are released and the cache is empty
        (length 0) before the error propagates: a half-grown cache is never left behind."""
        if total <= self.capacity:
            return False
        cap = capacity_bucket(total, self.floor, self.max_capacity)
        n = self.length
        new_k, new_v = [], []
        try:
            for layer in range(self.num_layers):
                k = self._alloc((1, self.num_kv_heads, cap, self.head_dim))
                v = self._alloc((1, self.num_kv_heads, cap, self.value_head_dim))
                if n:
                    k[:, :, :n] = self.keys[layer][:, :, :n]
                    v[:, :, :n] = self.values[layer][:, :, :n]
                new_k.append(k)
                new_v.append(v)
                if self.keys:  # free the old layer before allocating the next one (peak = one layer extra)
                    self.keys[layer] = None
                    self.values[layer] = None
        except BaseException:
            del new_k, new_v
            self.reset(free=True)
            raise
        self.keys, self.values = new_k, new_v
        self.capacity = cap
        self.generation += 1
        return True

    def _torch_empty(self, shape: tuple[int, ...]) -> Any:
        import torch

        return torch.empty(shape, dtype=self.dtype, device=self.device)

    # --- length -----------------------------------------------------------------------------

    def set_length(self, n: int) -> None:
        assert 0 <= n <= self.capacity, (n, self.capacity)
        self.length = n

    def rewind_to(self, n: int) -> None:
        """Keep the first `n` positions (O(1): only the length changes)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"rewind_to({n}) outside [0, {self.length}]")
        self.length = n

    def reset(self, free: bool = False) -> None:
        """Empty the cache; with `free`, also release the buffers."""
        self.length = 0
        if free:
            self.keys, self.values = [], []
            self.capacity = 0
            self.generation += 1

    # --- access -----------------------------------------------------------------------------

    def write(self, layer: int, start: int, k: Any, v: Any) -> None:
        """Write `k`/`v` (`[1, kv_heads, n, head_dim]`) at positions `[start, start + n)` in place."""
        n = k.shape[2]
        assert start + n <= self.capacity, (start, n, self.capacity)
        self.keys[layer][:, :, start : start + n].copy_(k)
        self.values[layer][:, :, start : start + n].copy_(v)

    def write_at(self, layer: int, index: Any, k: Any, v: Any) -> None:
        """Write at positions given by a device index tensor (`[n]` int64): CUDA-graph safe."""
        self.keys[layer].index_copy_(2, index, k)
        self.values[layer].index_copy_(2, index, v)

    def view(self, layer: int, total: int) -> tuple[Any, Any]:
        """Views of the first `total` positions of a layer's K and V."""
        return self.keys[layer][:, :, :total], self.values[layer][:, :, :total]

    def export(self) -> list[tuple[Any, Any]]:
        """Host copies of the valid positions: per layer `(k, v)` `[kv_heads, length, head_dim]`
        (`storage.host_copy`)."""
        from onnxgen.kv.storage import host_copy

        n = self.length
        return [
            (host_copy(k[0, :, :n]), host_copy(v[0, :, :n]))
            for k, v in zip(self.keys, self.values, strict=True)
        ]

    def load(self, layers: Any) -> None:
        """Replace the cache by `layers` (per layer `(k, v)` host arrays `[kv_heads, n, head_dim]`, as
        `export` gives): length n. An allocation failure leaves the cache empty (`reserve`)."""
        from onnxgen.kv.storage import from_host

        assert len(layers) == self.num_layers, (len(layers), self.num_layers)
        n = int(layers[0][0].shape[1]) if layers else 0
        self.reset()
        self.reserve(n)
        for i, (k, v) in enumerate(layers):
            self.keys[i][0, :, :n] = from_host(k, self.keys[i])
            self.values[i][0, :, :n] = from_host(v, self.values[i])
        self.set_length(n)

    def nbytes(self) -> int:
        """Device bytes the buffers hold now (allocated capacity, not only the valid length)."""
        return sum(int(t.nbytes) for t in (*self.keys, *self.values) if t is not None)
