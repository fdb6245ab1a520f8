"""Products of several rows over a constant float32 `[K, N]` weight on the CPU: oneDNN over a copy of the
weight prepacked once at load.

MKL's `x @ w` packs the weight again at every call; at the row counts of verify steps and short prefill
chunks (2..32 rows) that costs several times the product itself (the lm_head's `[5, 576] x [576, 49152]`
measured about 3x oneDNN's time over the prepacked copy, `docs/benchmarks/cpu.md`). One-row products (decode
steps) keep `x @ w`: MKL's GEMV reads the mapped weight as fast, and a decode step's values stay what they
were. The cost: a second copy of every float32 product weight in memory (`ONNXGEN_CPU_PREPACK=0`: none).

- `prepack(w)`: the packed copy of a `[K, N]` float32 CPU weight, or None where oneDNN is unavailable.
- `product(x, w, packed)`: `x @ w` (any leading dims); over `packed` when x has several rows.
"""

from __future__ import annotations

import functools

import torch

import onnxgen.envs as envs

# the row count the packed layout is chosen for (oneDNN's batch hint): a verify step's few rows
PACK_ROWS = 8


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
    """`x @ w` for `w` `[K, N]`: one row (or no `packed`) by torch's matmul, several rows by oneDNN over
    `packed` (`prepack(w)`), float32 accumulation either way."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if packed is None or rows <= 1 or x.dtype != torch.float32:
        return torch.matmul(x, w)
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, k), packed, None, "none", [], "")
    return y.view(*x.shape[:-1], w.shape[1])
