"""int4 block quantization (numpy) in the layout MatMulNBits and GatherBlockQuantized read.

Blocks of `BLOCK_SIZE` along K; values packed two per byte by `onnxgen.package.int4`.
"""

from __future__ import annotations

import numpy as np

from onnxgen.package.int4 import pack_nibbles, unpack_nibbles

BLOCK_SIZE = 32  # int4 block size (MatMulNBits and GatherBlockQuantized)
DEFAULT_ZERO_POINT = 8  # onnxruntime's zero point when none is given


def quantize_int4(
    w: np.ndarray, zero_points: bool = False, block_size: int = BLOCK_SIZE
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Quantize `w` [N, K] block-wise along K: returns (packed [N, ceil(K/bs), bs/2] uint8,
    scales [N, ceil(K/bs)] float32, packed zero points [N, ceil(nb/2)] uint8 or None).

    Symmetric (no zero points): q = clip(round(w/s), -8, 7) + 8 with s = absmax/7 (zero point 8).
    Asymmetric: s = (max-min)/15, zp = clip(round(-min/s), 0, 15), q = clip(round(w/s)+zp, 0, 15).
    Dequantized weight = (q - zp) * s. K is zero-padded to whole blocks; an odd block count leaves
    8 in the last zero-point byte's high nibble. Does not mutate `w`.
    """
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    nb = -(-k // block_size)
    pad = nb * block_size - k
    blocks = np.pad(w, ((0, 0), (0, pad))).reshape(n, nb, block_size)
    if zero_points:
        lo = np.minimum(blocks.min(axis=-1), 0.0)
        hi = np.maximum(blocks.max(axis=-1), 0.0)
        scale = (hi - lo) / 15.0
        scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
        zp = np.clip(np.round(-lo / scale), 0, 15).astype(np.uint8)
        q = np.clip(np.round(blocks / scale[..., None]) + zp[..., None], 0, 15).astype(np.uint8)
    else:
        absmax = np.abs(blocks).max(axis=-1)
        scale = np.where(absmax == 0, 1.0, absmax / 7.0).astype(np.float32)
        q = (np.clip(np.round(blocks / scale[..., None]), -8, 7) + DEFAULT_ZERO_POINT).astype(np.uint8)
    zpp = pack_nibbles(zp, fill=DEFAULT_ZERO_POINT) if zero_points else None
    return pack_nibbles(q), scale, zpp


def dequantize_int4(
    packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, k: int
) -> np.ndarray:
    """Inverse of `quantize_int4` (returns float32 [N, k]; scales of any float dtype, read as float32)."""
    n, nb, _ = packed.shape
    q = unpack_nibbles(packed).astype(np.float32)
    if zero_points is None:
        zp = np.full((n, nb), float(DEFAULT_ZERO_POINT), dtype=np.float32)
    else:
        zp = unpack_nibbles(zero_points, nb).astype(np.float32)
    w = (q - zp[..., None]) * np.asarray(scales, dtype=np.float32).reshape(n, nb)[..., None]
    return w.reshape(n, -1)[:, :k]
