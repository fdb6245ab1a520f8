"""The MatMulNBits / GatherBlockQuantized nibble layout: two 4-bit values per uint8 byte.

Layout (onnxruntime's, for B, zero points and GatherBlockQuantized data alike), along the last axis:

    values   v0 v1 | v2 v3 | ... | v(2j) v(2j+1) | ...
    bytes    b0    | b1    | ... | bj            | ...      bj = v(2j) | v(2j+1) << 4

element 2j sits in the low nibble of byte j, element 2j+1 in its high nibble. An odd count leaves the
last byte's high nibble unused (`pack_nibbles` writes `fill` there; `unpack_nibbles(..., n)` drops it).

Both functions take numpy arrays or torch tensors and return the same kind (same device for torch):
they use only slicing, `&`, `>>`, `<<`, `|` and one allocation chosen by the input's type, so the
numpy and torch paths are the same code. Neither mutates its input; torch is never imported here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["pack_nibbles", "unpack_nibbles"]


def pack_nibbles(q: Any, fill: int = 0) -> Any:
    """uint8 values 0..15 `[..., n]` -> packed uint8 `[..., ceil(n/2)]` (layout in the module docstring).

    For odd n the last byte's high nibble is `fill` (0..15). Raises TypeError unless `q` is uint8 and
    ValueError for a `fill` outside 0..15. Values above 15 are not checked (their high bits leak).
    """
    _check_uint8(q)
    if not 0 <= fill <= 15:
        raise ValueError(f"fill must be in 0..15, got {fill}")
    n = q.shape[-1]
    out = _empty(q, (*q.shape[:-1], (n + 1) // 2))
    out[...] = q[..., 0::2]
    out[..., : n // 2] |= q[..., 1::2] << 4
    if n % 2:
        out[..., -1] |= fill << 4
    return out


def unpack_nibbles(packed: Any, n: int | None = None) -> Any:
    """Packed uint8 `[..., m]` -> uint8 values 0..15 `[..., 2m]`, or its first `n` along the last axis.

    Raises TypeError unless `packed` is uint8 and ValueError unless 0 <= n <= 2m.
    """
    _check_uint8(packed)
    m = packed.shape[-1]
    if n is not None and not 0 <= n <= 2 * m:
        raise ValueError(f"n must be in 0..{2 * m} for {m} packed bytes, got {n}")
    out = _empty(packed, (*packed.shape[:-1], 2 * m))
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out if n is None or n == 2 * m else out[..., :n]


def _check_uint8(x: Any) -> None:
    # NOTE: signed bytes would sign-extend under `>>`; numpy says "uint8", torch "torch.uint8".
    if str(x.dtype) not in ("uint8", "torch.uint8"):
        raise TypeError(f"nibble packing works on uint8, got {x.dtype}")


def _empty(like: Any, shape: tuple[int, ...]) -> Any:
    """An uninitialized array of `like`'s kind, dtype (and torch device) with `shape`."""
    if isinstance(like, np.ndarray):
        return np.empty(shape, dtype=like.dtype)
    return like.new_empty(shape)
