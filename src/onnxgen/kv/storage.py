"""Page storage of the paged KV pool: one tensor allocated once, in the model's dtype, on the device.

Layout: `[layers, 2, num_pages, page_size, kv_heads, head_dim]` (2 = keys, values). A layer's keys are
the view `[num_pages, page_size, kv_heads, head_dim]`, the layout paged attention kernels read through a
page table (a page of one head is `page_size` rows of `head_dim`); flattened to
`[num_pages * page_size, kv_heads, head_dim]` a token's slot `page * page_size + offset` is one row, so
writing a step's keys is one `index_copy_` per layer.

Storage only stores: which page belongs to whom is `kv/pages.py`'s and `kv/prefix.py`'s business. torch is
imported lazily (kv/ imports no backend).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def host_copy(a: Any) -> Any:
    """A copy of a KV tensor (torch on any device, or numpy) as a C-contiguous host numpy array that shares no
    memory with it (one copy, whatever the source's device and strides), bfloat16 as its raw uint16 (the
    storage type of `kv.files`)."""
    import numpy as np

    if isinstance(a, np.ndarray):
        out = np.array(a, order="C", copy=True)
        return out.view(np.uint16) if out.dtype.name == "bfloat16" else out
    import torch

    t = torch.empty(tuple(a.shape), dtype=a.dtype)
    t.copy_(a.detach())
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def from_host(a: Any, like: Any) -> Any:
    """`a` (a host array as `host_copy` gives, or a view of one along its first axes) as an array of `like`'s
    kind, dtype and device; with a torch `like`, `a` may also be a torch tensor on any device (no copy where it
    already is what `like` is)."""
    import numpy as np

    if isinstance(like, np.ndarray):
        return a.view(like.dtype) if like.dtype.name == "bfloat16" else a.astype(like.dtype, copy=False)
    import torch

    if isinstance(a, torch.Tensor):
        return a.to(device=like.device, dtype=like.dtype)
    if like.dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(like.device)
    return torch.from_numpy(a).to(device=like.device, dtype=like.dtype)


def page_bytes(num_layers: int, page_size: int, kv_heads: int, head_dim: int, element_size: int) -> int:
    """Bytes one page takes across all layers (keys and values)."""
    return num_layers * 2 * page_size * kv_heads * head_dim * element_size


class PageStorage:
    """The pool's tensor and the few operations on whole pages the manager and the runner need."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: Any,
        device: Any,
        copy_prefix: Callable[[Any, int, int, int], None] | None = None,
    ) -> None:
        """`copy_prefix(data, src, dst, n)`: how the owner's device copies a page prefix in every layer
        (default: a torch slice copy)."""
        import torch

        self._copy_prefix = copy_prefix
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.data = torch.empty(
            (num_layers, 2, num_pages, page_size, kv_heads, head_dim), dtype=dtype, device=device
        )

    @property
    def dtype(self) -> Any:
        return self.data.dtype

    @property
    def device(self) -> Any:
        return self.data.device

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def keys(self, layer: int) -> Any:
        """`[num_pages, page_size, kv_heads, head_dim]` view of a layer's keys."""
        return self.data[layer, 0]

    def values(self, layer: int) -> Any:
        return self.data[layer, 1]

    def rows(self, layer: int) -> tuple[Any, Any]:
        """A layer's keys and values as `[1, kv_heads, num_pages * page_size, head_dim]` views, whose rows
        are slots (the layout of a contiguous per-sequence cache, with slots for positions)."""
        n = self.num_pages * self.page_size
        k = self.data[layer, 0].view(n, self.kv_heads, self.head_dim).permute(1, 0, 2).unsqueeze(0)
        v = self.data[layer, 1].view(n, self.kv_heads, self.head_dim).permute(1, 0, 2).unsqueeze(0)
        return k, v

    def write(self, layer: int, slots: Any, k: Any, v: Any) -> None:
        """Write `k`/`v` (`[T, kv_heads, head_dim]`) at `slots` (`[T]` int64 on the device), in place."""
        rows = self.num_pages * self.page_size
        self.data[layer, 0].view(rows, self.kv_heads, self.head_dim).index_copy_(0, slots, k)
        self.data[layer, 1].view(rows, self.kv_heads, self.head_dim).index_copy_(0, slots, v)

    def gather(self, layer: int, pages: Any, length: int) -> tuple[Any, Any]:
        """Keys and values of positions [0, length) of a sequence whose page table is `pages` (`[n]`
        int64), as contiguous `[kv_heads, length, head_dim]` tensors (the CPU reference path)."""
        k = self.data[layer, 0].index_select(0, pages).flatten(0, 1)[:length]
        v = self.data[layer, 1].index_select(0, pages).flatten(0, 1)[:length]
        return k.transpose(0, 1), v.transpose(0, 1)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Copy positions [0, n) of page `src` into page `dst`, in every layer (copy on write)."""
        if self._copy_prefix is not None:
            self._copy_prefix(self.data, src, dst, n)
        else:
            self.data[:, :, dst, :n].copy_(self.data[:, :, src, :n])
