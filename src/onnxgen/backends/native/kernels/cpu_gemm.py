"""Products over a constant float32 `[K, N]` weight on the CPU: the weight split into one column block per
torch thread, and oneDNN over a copy prepacked once at load.

MKL's `x @ w` runs a one-row product (a decode step's GEMV) on one thread whatever torch's thread count,
and packs the weight again at every call of a few-row product. Two layouts made at load address that:

- Split (`ONNXGEN_CPU_SPLIT`, on by default; with more than one torch thread): the weight stored as
  `[parts, K, N / parts]`, one block of columns per thread, in place of `[K, N]` (no second copy). A product
  of up to `SPLIT_ROWS` rows is one batched product over the blocks (torch runs the blocks on its threads at
  once: a decode step's GEMVs read the weights on every core); longer chunks (prefill) run a threaded GEMM
  per block. The values are those of `x @ w` up to the summation order inside a dot product.
- Prepacked (`ONNXGEN_CPU_PREPACK=1`, opt-in: a second copy of every product weight): oneDNN's packed
  copy, read by products of 2..`FEW_ROWS` rows (verify steps); worst in the few-row lm_head without it.

- `split(w, parts)`: the split layout of a `[K, N]` float32 CPU weight, or None (off, one part, N not a
  multiple of `parts`, another dtype or device).
- `prepack(w)`: the packed copy of a `[K, N]` float32 CPU weight, or None where oneDNN is unavailable.
- `product(x, w, packed)`: `x @ w` (any leading dims) for `w` `[K, N]` or split; over `packed` when x has a
  few rows (`FEW_ROWS`).
- `out_features(w)`: N for either layout.
"""

from __future__ import annotations

import functools
import mmap

import torch

import onnxgen.envs as envs

# the row count the packed layout is chosen for (oneDNN's batch hint): a verify step's few rows
PACK_ROWS = 8
# products of 2..this many rows read the packed copy; prompt chunks keep MKL (slower through oneDNN end to
# end, `docs/benchmarks/cpu.md`: each new row count has oneDNN build a new kernel)
FEW_ROWS = 16
# products of up to this many rows over a split weight run as one batched product, a block per thread;
# longer chunks (prefill) run MKL's threaded GEMM per block, which a single thread per block falls behind
SPLIT_ROWS = 32
_HUGE_PAGE = 2 << 20


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


def split_parts() -> int:
    """How many column blocks the lowering splits CPU float32 product weights into: torch's intra-op thread
    count at load, 1 (no split) with `ONNXGEN_CPU_SPLIT=0`."""
    return torch.get_num_threads() if envs.read("CPU_SPLIT") else 1


def split(w: torch.Tensor, parts: int) -> torch.Tensor | None:
    """`w` (`[K, N]` float32 on the CPU) as `[parts, K, N / parts]` (block p: columns `p * N / parts` on),
    contiguous; None when it cannot or need not be split (`parts` < 2, N not a multiple of it)."""
    if parts < 2 or w.device.type != "cpu" or w.dtype != torch.float32 or w.dim() != 2:
        return None
    k, n = w.shape
    if n % parts or n < 2 * parts:
        return None
    out = _huge_pages_empty((parts, k, n // parts))
    return out.copy_(w.reshape(k, parts, n // parts).permute(1, 0, 2))


def _huge_pages_empty(shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised float32 tensor in anonymous memory the kernel is asked to back with huge pages
    (`madvise(MADV_HUGEPAGE)`, where the platform has it): fewer TLB misses while a product streams the
    weight (torch's allocator asks for them only under its THP_MEM_ALLOC_ENABLE)."""
    count = 1
    for s in shape:
        count *= s
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if advise is None or count * 4 < _HUGE_PAGE:
        return torch.empty(shape, dtype=torch.float32)
    region = mmap.mmap(-1, -(-count * 4 // _HUGE_PAGE) * _HUGE_PAGE)
    try:
        region.madvise(advise)
    except OSError:  # not allowed here: ordinary pages
        pass
    return torch.frombuffer(region, dtype=torch.float32, count=count).view(shape)


def out_features(w: torch.Tensor) -> int:
    """N of a `[K, N]` weight or of its split layout `[parts, K, N / parts]`."""
    return w.shape[0] * w.shape[2] if w.dim() == 3 else w.shape[1]


def prepack(w: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of `w` (`[K, N]` float32 on the CPU) for `product`, or None: another dtype or
    device, oneDNN unavailable, or `ONNXGEN_CPU_PREPACK` off (read here, at load)."""
    if w.device.type != "cpu" or w.dtype != torch.float32 or w.dim() != 2 or not envs.read("CPU_PREPACK"):
        return None
    if not available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), PACK_ROWS)


def product(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
    """`x @ w` for `w` `[K, N]` or its `split` layout: 2..`FEW_ROWS` rows by oneDNN over `packed`
    (`prepack(w)`), others (or without `packed`) by torch's matmul (over a split weight: one batched product
    of the blocks, or a GEMM per block for more than `SPLIT_ROWS` rows); float32 accumulation either way."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    n = out_features(w)
    if packed is not None and 1 < rows <= FEW_ROWS and x.dtype == torch.float32:
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, k), packed, None, "none", [], "")
        return y.view(*x.shape[:-1], n)
    if w.dim() == 2:
        return torch.matmul(x, w)
    x2 = x.reshape(rows, k)
    if rows <= SPLIT_ROWS:  # [parts, rows, N / parts] -> [rows, N]: a view for one row
        y = torch.matmul(x2, w).transpose(0, 1).reshape(rows, n)
    else:
        y = torch.cat([torch.matmul(x2, part) for part in w.unbind(0)], dim=1)
    return y.view(*x.shape[:-1], n)
