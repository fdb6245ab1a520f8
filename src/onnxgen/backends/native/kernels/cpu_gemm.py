"""Products of several rows over a constant float32 `[K, N]` weight on the CPU: oneDNN over a copy of the
weight prepacked once at load.

MKL's `x @ w` packs the weight again at every call; at the row counts of verify steps (2..16 rows) that
costs several times the product itself, most of all in the lm_head (`docs/benchmarks/cpu.md`). One-row
products (decode steps) keep `x @ w`: MKL's GEMV reads the mapped weight as fast, and a decode step's values
stay what they were. The cost: a second copy of every float32 product weight in memory
(only with `ONNXGEN_CPU_PREPACK=1`: it doubles the products' weight memory).

- `prepack(w)`: the packed copy of a `[K, N]` float32 CPU weight, or None where oneDNN is unavailable.
- `product(x, w, packed)`: `x @ w` (any leading dims); over `packed` when x has a few rows (`FEW_ROWS`).
"""

from __future__ import annotations

import functools

import torch

import onnxgen.envs as envs

# the row count the packed layout is chosen for (oneDNN's batch hint): a verify step's few rows
PACK_ROWS = 8
# products of 2..this many rows read the packed copy; prompt chunks keep MKL (slower through oneDNN end to
# end, `docs/benchmarks/cpu.md`: each new row count has oneDNN build a new kernel)
FEW_ROWS = 16


@functools.cache
def available() -> bool:
    """Whether this torch build runs oneDNN's prepacked linear (checked once on a tiny product)."""
    try:
        w = torch.ones(4, 2)
        p = torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), PACK_ROWS)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(3, 4), p, None, "none", [], "")
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return bool(torch.equal(y, torch.full((3, 2), 4.0)))


def prepack(w: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of `w` (`[K, N]` float32 on the CPU) for `product`, or None: another dtype or
    device, oneDNN unavailable, or `ONNXGEN_CPU_PREPACK` off (read here, at load)."""
    if w.device.type != "cpu" or w.dtype != torch.float32 or w.dim() != 2 or not envs.read("CPU_PREPACK"):
        return None
    if not available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), PACK_ROWS)


def product(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
    """`x @ w` for `w` `[K, N]`: 2..`FEW_ROWS` rows by oneDNN over `packed` (`prepack(w)`), others (or
    without `packed`) by torch's matmul; float32 accumulation either way."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if packed is None or not 1 < rows <= FEW_ROWS or x.dtype != torch.float32:
        return torch.matmul(x, w)
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, k), packed, None, "none", [], "")
    return y.view(*x.shape[:-1], w.shape[1])
