"""Initializers and Constant tensors as torch tensors, with external data memory-mapped.

External data files are mapped once (`numpy.memmap`, read-only); each initializer becomes a
zero-copy torch view of its bytes, then is moved to the target device once. bfloat16 has no numpy
dtype: its bytes are read as uint16 and reinterpreted.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

# ONNX TensorProto.DataType -> (numpy storage dtype, torch dtype)
ONNX_TO_TORCH: dict[int, torch.dtype] = {
    1: torch.float32,
    2: torch.uint8,
    3: torch.int8,
    5: torch.int16,
    6: torch.int32,
    7: torch.int64,
    9: torch.bool,
    10: torch.float16,
    11: torch.float64,
    12: torch.uint32,
    13: torch.uint64,
    16: torch.bfloat16,
    4: torch.uint16,
}
_NP_STORAGE: dict[int, Any] = {
    1: np.float32,
    2: np.uint8,
    3: np.int8,
    4: np.uint16,
    5: np.int16,
    6: np.int32,
    7: np.int64,
    9: np.bool_,
    10: np.float16,
    11: np.float64,
    12: np.uint32,
    13: np.uint64,
    16: np.uint16,
    21: np.uint8,
    22: np.uint8,  # UINT4 / INT4: packed two per byte
    24: np.uint8,  # FLOAT8E8M0 (MXFP4 block scales, 2^(s - 127)): the raw bytes, read as uint8
}
INT4_TYPES = (21, 22)


class ExternalData:
    """Memory maps of a graph's external data files, opened lazily and shared."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        self._maps: dict[str, np.memmap] = {}

    def bytes(self, location: str, offset: int, length: int | None) -> np.ndarray:
        mm = self._maps.get(location)
        if mm is None:
            mm = np.memmap(self.base_dir / location, dtype=np.uint8, mode="r")
            self._maps[location] = mm
        end = len(mm) if length is None else offset + length
        return mm[offset:end]


def _from_numpy(arr: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only memory maps: we never write through these views
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def tensor_from_proto(t: Any, ext: ExternalData) -> torch.Tensor:
    """A CPU torch tensor for a TensorProto (zero-copy over the memory map when external).

    INT4/UINT4 tensors come back as their packed uint8 bytes (shape: flat byte count)."""
    from onnx import TensorProto, numpy_helper

    dt = t.data_type
    if dt not in _NP_STORAGE:
        raise ValueError(f"initializer {t.name!r} has unsupported ONNX data type {dt}")
    dims = tuple(int(d) for d in t.dims)
    numel = int(np.prod(dims)) if dims else 1
    np_dtype = _NP_STORAGE[dt]
    if dt in INT4_TYPES:
        count = (numel + 1) // 2
        shape: tuple[int, ...] = (count,)
    else:
        count, shape = numel, dims
    raw: np.ndarray | None = None
    if t.data_location == TensorProto.EXTERNAL:
        info = {kv.key: kv.value for kv in t.external_data}
        length = int(info["length"]) if "length" in info else None
        raw = ext.bytes(info["location"], int(info.get("offset", 0)), length)
    elif t.HasField("raw_data"):
        raw = np.frombuffer(t.raw_data, dtype=np.uint8)
    if raw is not None:
        arr = np.frombuffer(raw, dtype=np_dtype, count=count) if count else np.zeros(0, np_dtype)
        arr = arr.reshape(shape)
    elif dt == 16:  # bf16 in int32_data
        arr = np.asarray(t.int32_data, dtype=np.uint32).astype(np.uint16).reshape(shape)
    elif dt == 10:
        arr = np.asarray(t.int32_data, dtype=np.uint16).view(np.float16).reshape(shape)
    elif dt in INT4_TYPES:
        arr = np.asarray(t.int32_data, dtype=np.uint8).reshape(shape)
    else:
        arr = np.asarray(numpy_helper.to_array(t)).astype(np_dtype, copy=False).reshape(shape)
    out = _from_numpy(arr)
    if dt == 16:
        out = out.view(torch.bfloat16)
    return out
