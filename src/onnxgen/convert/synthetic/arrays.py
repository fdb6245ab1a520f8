"""Weights as numpy arrays or torch tensors, and the three float dtypes by name ("float32",
"float16", "bfloat16"): telling the two kinds apart, converting, rounding, and raw bytes.

torch is imported only when a torch tensor is passed in, or to speed up a numpy transpose and the
bfloat16 cast (then only if installed; results are the same without it). Nothing mutates its input.
"""

from __future__ import annotations

from typing import Any

import numpy as np

ONNX_FLOAT_TYPES = {"float32": 1, "float16": 10, "bfloat16": 16}  # dtype name -> onnx TensorProto type


def is_torch(x: Any) -> bool:
    """Whether `x` is a torch tensor (told apart without importing torch)."""
    return hasattr(x, "detach")


def as_np(x: Any) -> np.ndarray:
    """float32 numpy array of `x` (a torch tensor is copied to the host; a float32 array is returned as is)."""
    return x.detach().float().cpu().numpy() if is_torch(x) else np.asarray(x, dtype=np.float32)


def cat(parts: list[Any], axis: int) -> Any:
    """Concatenate arrays of one kind along `axis` (a single part is returned as is)."""
    if len(parts) == 1:
        return parts[0]
    if is_torch(parts[0]):
        import torch

        return torch.cat(parts, dim=axis)
    return np.concatenate(parts, axis=axis)


def transpose(x: Any) -> Any:
    """Transpose a 2-D array: a view for torch, a (torch-accelerated when possible) copy for numpy."""
    if is_torch(x):
        return x.t()
    try:
        import torch

        return torch.from_numpy(np.ascontiguousarray(x)).t().contiguous().numpy()
    except ImportError:
        return np.ascontiguousarray(x.T)


def np_dtype(dtype: str) -> Any:
    """The numpy dtype for a dtype name (bfloat16 from ml_dtypes)."""
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def round_to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 copy of `x` holding the values `x` takes once stored as `dtype`."""
    if dtype == "float32":
        return np.asarray(x, dtype=np.float32)
    return np.asarray(x, dtype=np.float32).astype(np_dtype(dtype)).astype(np.float32)


def to_bytes(x: Any, dtype: str | None) -> memoryview | bytes:
    """Little-endian raw bytes of `x` cast to `dtype` (None: keep x's dtype, e.g. uint8)."""
    if is_torch(x):
        import torch

        if dtype is not None:
            x = x.to({"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype])
        x = x.contiguous().cpu()
        if x.dtype in (torch.float16, torch.bfloat16):
            x = x.view(torch.int16)
        return memoryview(np.ascontiguousarray(x.numpy())).cast("B")
    x = np.asarray(x)
    if dtype is not None and x.dtype != np_dtype(dtype):
        if dtype == "bfloat16":
            x = _cast_bf16(x)
        else:
            x = x.astype(np_dtype(dtype))
    x = np.ascontiguousarray(x)
    if x.dtype.itemsize == 2 and x.dtype != np.float16:
        x = x.view(np.uint16)
    return memoryview(x).cast("B")


def _cast_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16, rounded to nearest even: uint16 bits via torch when available (multithreaded),
    else an ml_dtypes bfloat16 array."""
    try:
        import torch

        t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16)
        return t.view(torch.int16).numpy().view(np.uint16)
    except ImportError:
        return x.astype(np_dtype("bfloat16"))
