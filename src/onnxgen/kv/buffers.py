"""Device KV storage owned by the runtime: one K and one V buffer per layer, in the model's dtype.

Layout per layer: `[1, kv_heads, capacity, head_dim]` ("BNSH", batch 1). New keys and values are
written in place at `[length : length + n]`; `rewind_to(n)` only sets the length (O(1)); capacity
grows in power-of-two buckets (never below `floor`) by copying the valid prefix into new buffers.
Nothing is mirrored to the host. This module imports no backend (ARCHITECTURE.md: `kv/` never
imports a backend); torch is imported lazily so `import onnxgen.kv` stays light.
"""

from __future__ import annotations

from typing import Any


def bucket_capacity(total: int, floor: int) -> int:
    """The smallest power of two >= max(total, floor)."""
    need = max(int(total), int(floor), 1)
    return 1 << (need - 1).bit_length()


class KVBuffers:
    """Per-layer K/V buffers `[1, kv_heads, capacity, head_dim]` plus the number of valid positions.

    Contract: positions `[0, length)` of every layer hold valid KV; positions at or beyond `length`
    are garbage and never read by attention. `reserve(total)` guarantees `capacity >= total` (growing
    by whole power-of-two buckets and preserving the valid prefix); it never shrinks. `length` is
    only changed by `set_length` / `rewind_to` / `reset` (the decoder advances it after a forward).
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
    ) -> None:
        if floor < 1:
            raise ValueError(f"kv floor must be >= 1, got {floor}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.value_head_dim = value_head_dim or head_dim
        self.dtype = dtype
        self.device = device
        self.floor = floor
        self.max_capacity = max_capacity
        self.length = 0
        self.capacity = 0
        self.keys: list[Any] = []
        self.values: list[Any] = []
        self.generation = 0  # bumps whenever the buffers are reallocated (CUDA graphs key on it)

    # --- capacity ---------------------------------------------------------------------------

    def reserve(self, total: int) -> bool:
        """Make room for `total` positions; return True when the buffers were reallocated."""
        if total <= self.capacity:
            return False
        import torch

        cap = bucket_capacity(total, self.floor)
        if self.max_capacity is not None and total <= self.max_capacity < cap:
            cap = max(self.max_capacity, self.capacity)
        n = self.length
        new_k, new_v = [], []
        for layer in range(self.num_layers):
            k = torch.empty((1, self.num_kv_heads, cap, self.head_dim), dtype=self.dtype, device=self.device)
            v = torch.empty(
                (1, self.num_kv_heads, cap, self.value_head_dim), dtype=self.dtype, device=self.device
            )
            if n:
                k[:, :, :n].copy_(self.keys[layer][:, :, :n])
                v[:, :, :n].copy_(self.values[layer][:, :, :n])
            new_k.append(k)
            new_v.append(v)
            if self.keys:  # free the old layer before allocating the next one (peak = one layer extra)
                self.keys[layer] = None
                self.values[layer] = None
        self.keys, self.values = new_k, new_v
        self.capacity = cap
        self.generation += 1
        return True

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

    def nbytes(self) -> int:
        """Device bytes the buffers hold now (allocated capacity, not only the valid length)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)
