"""Int4 weights. By default (`int4="dense"`) dequantized once at load: MatMulNBits' B and
GatherBlockQuantized's table to dense tensors, which the lowering then runs as a `Linear` and a `Gather` (see
`linear` and `tensor`). With `int4="packed"` (`device.int4_mode`) MatMulNBits stays packed on the device as
the lowering's `Int4Linear`, its bytes held K-major (`kmajor`, once at load: the same bytes, reordered for the
GEMV's loads): decode rows (at most `GEMV_ROWS`) run the Triton GEMV on the packed words (`kernels/triton/int4.py`),
longer chunks and the CPU dequantize the weight for that call (`dequant_kmajor`; the weight's memory stays the
packed size)."""

from __future__ import annotations

import math
from typing import Any

import torch

from onnxgen.backends.native.ops.base import INTERNAL, Builder, Fn, Node, RunCtx, is_rowwise, nonneg_axis
from onnxgen.package.int4 import unpack_nibbles


def trivial_g_idx(g: torch.Tensor, k: int, block: int) -> bool:
    """Whether `g` (MatMulNBits' g_idx) maps each input feature k to its own block `k // block` (the order
    MatMulNBits assumes without one: such a g_idx says nothing)."""
    return g.numel() == k and bool(torch.equal(g.reshape(-1).long().cpu(), torch.arange(k) // block))


def dequant_matmul_nbits(
    b: torch.Tensor,
    scales: torch.Tensor,
    zp: torch.Tensor | None,
    k: int,
    n: int,
    bits: int,
    block: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """MatMulNBits' B (uint8 `[N, n_blocks, blob]`) -> dense `[N, K]` in `dtype` (computed in float32)."""
    if bits != 4:
        raise NotImplementedError(f"MatMulNBits bits={bits}")
    nb = (k + block - 1) // block
    b = b.reshape(n, nb, block // 2).to(torch.uint8)
    q = unpack_nibbles(b).float()
    sc = scales.reshape(n, nb, 1).float()
    if zp is None:
        z = torch.full((n, nb, 1), 8.0, device=b.device)
    elif zp.dtype == torch.uint8:
        per_row = (nb + 1) // 2
        z = unpack_nibbles(zp.reshape(n, per_row).to(torch.uint8), nb).float().reshape(n, nb, 1)
    else:
        z = zp.reshape(n, nb, 1).float()
    w = ((q - z) * sc).reshape(n, nb * block)[:, :k]
    return w.to(dtype).contiguous()


def kmajor(
    b: torch.Tensor, scales: torch.Tensor, zp: torch.Tensor | None, k: int, n: int, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """MatMulNBits' 4-bit B (uint8 `[N, n_blocks, block / 2]`), scales (`[N * n_blocks]`) and zero points
    (packed uint8 `[N, ceil(n_blocks / 2)]`, floats `[N * n_blocks]`, or None) -> the K-major tensors of
    `kernels/triton/int4.py`'s `int4_linear`: int32 words `[n_blocks * block / 8, N]` (word (r, c): elements 8r .. 8r + 7
    of row c, nibble j = element 8r + j: B's own bytes, transposed in 4-byte units), scales `[n_blocks, N]`,
    zero points `[n_blocks, N]` (uint8, one per block; floats stay floats) or None. `block` must be a
    multiple of 8 (the builder's are powers of two from 16)."""
    if block % 8:
        raise NotImplementedError(f"MatMulNBits block_size={block} (packed int4 needs a multiple of 8)")
    nb = (k + block - 1) // block
    words = b.reshape(n, nb * block // 2).to(torch.uint8).contiguous().view(torch.int32)  # [N, K/8]
    zt = None
    if zp is not None and zp.dtype == torch.uint8:
        zt = unpack_nibbles(zp.reshape(n, (nb + 1) // 2).to(torch.uint8), nb).reshape(n, nb).T.contiguous()
    elif zp is not None:
        zt = zp.reshape(n, nb).T.contiguous()
    return words.T.contiguous(), scales.reshape(n, nb).T.contiguous(), zt


def dequant_kmajor(
    words: torch.Tensor,
    scales: torch.Tensor,
    zp: torch.Tensor | None,
    k: int,
    n: int,
    block: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """`kmajor`'s tensors -> dense `[N, K]` in `dtype` (computed in float32): `dequant_matmul_nbits`'s values."""
    q = unpack_nibbles(words.T.contiguous().view(torch.uint8)).float()  # B's own bytes again: [N, K padded]
    nb = scales.shape[0]
    z = torch.full((n, nb), 8.0, device=words.device) if zp is None else zp.T.float()
    w = (q.reshape(n, nb, block) - z[:, :, None]) * scales.T.float()[:, :, None]
    return w.reshape(n, nb * block)[:, :k].to(dtype).contiguous()


def dequant_gather_block(
    data: torch.Tensor,
    scales: torch.Tensor,
    zp: torch.Tensor | None,
    *,
    bits: int,
    block: int,
    quant_axis: int,
    signed: bool,
    shape: tuple[int, ...],
) -> torch.Tensor:
    """GatherBlockQuantized's table -> dense float (scales' dtype). `data` is packed uint8 for 4 bits."""
    if bits != 4:
        raise NotImplementedError(f"GatherBlockQuantized bits={bits}")
    raw = data.reshape(-1).to(torch.uint8)
    vals = unpack_nibbles(raw, math.prod(shape)).to(torch.int16)
    if signed:
        vals = torch.where(vals >= 8, vals - 16, vals)
    q = vals.reshape(shape).float()
    qa = nonneg_axis(quant_axis, len(shape))
    sc = scales.float().repeat_interleave(block, dim=qa).narrow(qa, 0, shape[qa])
    if zp is None:
        z = torch.zeros((), device=data.device) if signed else torch.full((), 8.0, device=data.device)
    else:
        zshape = list(scales.shape)
        if zp.dim() >= 2:  # uint8 zero points: packed per row along the last axis
            zv = unpack_nibbles(zp.to(torch.uint8), zshape[-1]).reshape(-1).to(torch.int16)
        else:  # INT4/UINT4 tensor: packed flat
            zv = unpack_nibbles(zp.reshape(-1).to(torch.uint8), math.prod(zshape)).to(torch.int16)
        if signed:
            zv = torch.where(zv >= 8, zv - 16, zv)
        z = zv.reshape(zshape).float().repeat_interleave(block, dim=qa).narrow(qa, 0, shape[qa])
    return ((q - z) * sc).to(scales.dtype)


GEMV_ROWS = 16  # Int4Linear rows at most this many run the packed GEMV (decode steps)
GEMM_ROWS = 256  # more rows, up to this many: the packed GEMM (`triton/int4_gemm.py`) where it times faster
# than dequantize-then-matmul for the shape and row count (batched decode steps, verify steps, short chunks);
# longer chunks: dequantize first, then one dense product

INT4_GEMM_CONFIGS = (
    (16, 64, 16, 4, 3),
    (16, 128, 16, 4, 3),
    (32, 64, 16, 4, 3),
    (32, 128, 32, 4, 3),
    (64, 64, 16, 4, 3),
    (64, 128, 16, 8, 3),
    (64, 64, 32, 4, 4),
    (128, 64, 16, 8, 3),
)
"""(rows, output columns, word rows per step, warps, stages) tried for each packed int4 GEMM shape and row
count (rounded up to a power of two), those of at most twice the rows; against dequantize-then-matmul."""


INT4_CONFIGS = (
    (16, 64, 4),
    (32, 64, 4),
    (16, 128, 8),
    (32, 128, 8),
    (64, 32, 4),
    (64, 64, 8),
    (32, 32, 2),
    (16, 32, 2),
    (8, 128, 4),
    (8, 256, 8),
    (16, 256, 16),
)
"""(output columns, word rows per step, warps) tried for each packed int4 GEMV shape (`kernels/triton/int4.py`); each
compiles to a loop with no barrier or shuffle on sm_90 (other shapes make Triton move x through shared memory
every step). 16 x 128 x 8 warps gives a 4,096-row product two programs of 8 warps per multiprocessor, for more
loads in flight; narrower and deeper tiles (8 x 128 x 4: twice the programs; 8 x 256 x 8 and 16 x 256 x 16: a
4,096-long K in two steps) keep more loads in flight where the widest tiles leave the warps waiting on their
loads, each with the same 8 words a thread per step (docs/benchmarks/decode-gpu.md has the timings)."""


def _int4_choice(
    x: Any, words: Any, scales: Any, zp: Any, k: int, n: int, block: int, silu: bool = False
) -> tuple[int, int, int]:  # pragma: cuda
    """The fastest `INT4_CONFIGS` entry for this shape on CUDA (`kernels.autotune.fastest`, weights from HBM; timed
    on the plain product, and reused when a norm is folded in); the first elsewhere."""
    from onnxgen.backends.native.kernels import autotune

    key = ("int4", tuple(words.shape), k, n, block, silu, x.dtype, x.device)
    if key in autotune.CHOICES:
        return autotune.CHOICES[key]
    if not x.is_cuda:
        return INT4_CONFIGS[0]
    from onnxgen.backends.native.kernels.triton.int4 import int4_linear

    x1 = x.reshape(-1, k)[:1]
    copies = autotune.cold_copies(words, scales)
    cands = [
        (
            cfg,
            lambda i, cfg=cfg: int4_linear(x1, copies[i][0], copies[i][1], zp, k, n, block, *cfg, silu=silu),
        )
        for cfg in INT4_CONFIGS
    ]
    return autotune.fastest(key, cands, len(copies))


def _int4_fold_choice(
    x: Any,
    words: Any,
    scales: Any,
    zp: Any,
    k: int,
    n: int,
    block: int,
    silu: bool,
    norm: tuple[Any, Any, float],
    cfg: tuple[int, int, int],
) -> bool:  # pragma: cuda
    """Whether the RMSNorm folded into the packed GEMV (`kernels/triton/int4.py`'s NORM) beats the norm kernel followed
    by the plain GEMV for this shape on CUDA (timed once, both with `cfg`, the norm's cost in both): the fold
    saves a launch but adds loads and squares (with a skip, also the residual store) for every word row a
    program walks, which is why it is timed per shape."""
    from onnxgen.backends.native.kernels import autotune
    from onnxgen.backends.native.kernels.norms import rms_norm
    from onnxgen.backends.native.kernels.triton.int4 import int4_linear

    key = ("int4fold", tuple(words.shape), k, n, block, silu, norm[0] is not None, x.dtype, x.device)
    if key in autotune.CHOICES:
        return bool(autotune.CHOICES[key])
    copies = autotune.cold_copies(words, scales)

    def apart(i: int) -> Any:
        h, _ = rms_norm(x, *norm)
        return int4_linear(h, copies[i][0], copies[i][1], zp, k, n, block, *cfg, silu=silu)

    def fold(i: int) -> Any:
        return int4_linear(x, copies[i][0], copies[i][1], zp, k, n, block, *cfg, silu=silu, norm=norm)

    return bool(autotune.fastest(key, [(False, apart), (True, fold)], len(copies)))


def _int4_gemm_choice(
    x: Any, words: Any, scales: Any, zp: Any, k: int, n: int, block: int, silu: bool
) -> tuple[int, int, int, int, int] | None:
    """The fastest `INT4_GEMM_CONFIGS` entry for this shape and row count on CUDA, or None where dequantize-
    then-matmul times faster (`kernels.autotune.fastest`, weights from HBM); the first that fits elsewhere."""
    from onnxgen.backends.native.kernels import autotune

    rows = 1 << (x.numel() // k - 1).bit_length()
    configs = [c for c in INT4_GEMM_CONFIGS if c[0] <= max(16, 2 * rows)]
    key = ("int4gemm", rows, tuple(words.shape), k, n, block, silu, x.dtype, x.device)
    if key in autotune.CHOICES:
        return autotune.CHOICES[key]
    if not x.is_cuda:
        return configs[0]
    # pragma: cuda-begin
    from onnxgen.backends.native.kernels.triton.int4 import int4_dequant
    from onnxgen.backends.native.kernels.triton.int4_gemm import int4_gemm

    cols = 2 * n if silu else n
    copies = autotune.cold_copies(words, scales)

    def dense(i: int) -> Any:
        return torch.matmul(x, int4_dequant(copies[i][0], copies[i][1], zp, k, cols, block, x.dtype))

    cands: list[tuple[Any, Any]] = [(None, dense)]
    cands += [
        (cfg, lambda i, cfg=cfg: int4_gemm(x, copies[i][0], copies[i][1], zp, k, n, block, *cfg, silu=silu))
        for cfg in configs
    ]
    return autotune.fastest(key, cands, len(copies))
    # pragma: cuda-end


def packed_product(
    x: Any,
    words: Any,
    scales: Any,
    zp: Any,
    k: int,
    n: int,
    block: int,
    silu: bool,
    norm: tuple[Any, Any, float] | None = None,
    residual: Any = None,
    rowwise: bool = False,
) -> Any:
    """x times the packed weights: the Triton GEMV for decode rows (at most `GEMV_ROWS`; any number when
    `rowwise`, a verify step's rows: each row then has a decode step's bits, one program per row), up to
    `GEMM_ROWS` rows the packed GEMM where `_int4_gemm_choice` timed it faster, else the weight
    dequantized for this call (`kernels/triton/int4.py`'s `int4_dequant` where Triton runs; float32 on the CPU) and one
    product, rounded to x's dtype (`silu`: then
    `silu(g) * u` of the halves, as the unfused ops). `norm` = (skip, weight, eps): x is RMS-normalised
    first and the result is (product, residual sum or None) — in the GEMV (`kernels/triton/int4.py`; on CUDA where
    `_int4_fold_choice` timed it faster) or by `kernels.norms.rms_norm` first. `residual` (`[..., N]`, not with
    `silu` or `norm`) is added to the product before it is rounded to x's dtype."""
    from onnxgen.backends.native.kernels.dispatch import use_triton
    from onnxgen.backends.native.kernels.norms import rms_norm, silu_mul_halves

    if use_triton(x) and (rowwise or x.numel() // k <= GEMV_ROWS):
        from onnxgen.backends.native.kernels.triton.int4 import int4_linear

        cfg = _int4_choice(x, words, scales, zp, k, n, block, silu)
        if (
            norm is None
            or not x.is_cuda
            or _int4_fold_choice(x, words, scales, zp, k, n, block, silu, norm, cfg)
        ):
            return int4_linear(
                x, words, scales, zp, k, n, block, *cfg, silu=silu, norm=norm, residual=residual
            )
    if norm is not None:
        h, total = rms_norm(x, *norm)
        return packed_product(h, words, scales, zp, k, n, block, silu, rowwise=rowwise), total
    if use_triton(x) and x.numel() // k <= GEMM_ROWS:
        gemm = _int4_gemm_choice(x, words, scales, zp, k, n, block, silu)
        if gemm is not None:
            from onnxgen.backends.native.kernels.triton.int4_gemm import int4_gemm

            return int4_gemm(x, words, scales, zp, k, n, block, *gemm, silu=silu, residual=residual)
    cols = 2 * n if silu else n
    if use_triton(x):  # one pass into a K-major dense weight, then one product
        from onnxgen.backends.native.kernels.triton.int4 import int4_dequant

        y = torch.matmul(x, int4_dequant(words, scales, zp, k, cols, block, x.dtype))
    else:
        w = dequant_kmajor(
            words, scales, zp, k, cols, block, torch.float32 if x.device.type == "cpu" else x.dtype
        )
        y = torch.nn.functional.linear(x.to(w.dtype), w)
    if residual is not None:
        y = y.float() + residual.float()
    y = y.to(x.dtype)
    return silu_mul_halves(y) if silu else y


def _int4_linear(node: Node) -> Fn:
    """The lowering's Int4Linear: inputs x, then `kmajor`'s words, scales and zero points ("" if none), the
    bias ("" if none) and a residual ("" if none; never with a bias): `x @ W.T (+ bias) (+ residual)`, the
    residual added before the product is rounded (the lowering moves a following skip-norm's sum here)."""
    k, n = int(node.attr("K")), int(node.attr("N"))
    block = int(node.attr("block_size"))

    def f(
        ctx: RunCtx, x: Any, words: Any, scales: Any, zp: Any = None, bias: Any = None, residual: Any = None
    ) -> tuple[Any, ...]:
        assert bias is None or residual is None
        y = packed_product(
            x, words, scales, zp, k, n, block, False, residual=residual, rowwise=is_rowwise(ctx)
        )
        return (y if bias is None else y + bias,)

    return f


def _int4_linear_silu_mul(node: Node) -> Fn:
    """The lowering's Int4LinearSiluMul: `silu(x @ Wg.T) * (x @ Wu.T)` for two bias-free Int4Linears of one
    input (N output columns each, the same K and block) whose `kmajor` tensors sit side by side (`2 * N`
    columns): inputs x, words, scales, zero points ("" if none). Decode rows: one GEMV launch with the SiLU
    in its epilogue (`kernels/triton/int4.py`, `silu=True`) instead of two products and the SiluMul."""
    k, n = int(node.attr("K")), int(node.attr("N"))
    block = int(node.attr("block_size"))

    def f(ctx: RunCtx, x: Any, words: Any, scales: Any, zp: Any = None) -> tuple[Any, ...]:
        return (packed_product(x, words, scales, zp, k, n, block, True, rowwise=is_rowwise(ctx)),)

    return f


def _rms_int4_linear(node: Node) -> Fn:
    """The lowering's RmsInt4Linear: a `(Skip)SimplifiedLayerNormalization` whose output only a packed
    Int4Linear / Int4LinearSiluMul reads. Inputs x, skip ("" if none), the norm weight, then `kmajor`'s
    words, scales and zero points; outputs (the product, the residual sum `x + skip` or None). Decode rows:
    one GEMV launch with the norm folded in (the normalised row is not rounded to x's dtype in between)
    where that times faster for the shape, else the norm kernel and the GEMV; longer chunks and the CPU:
    the norm, then the product (the two ops' values)."""
    k, n = int(node.attr("K")), int(node.attr("N"))
    block, silu, eps = (
        int(node.attr("block_size")),
        bool(node.attr("silu", 0)),
        float(node.attr("epsilon", 1e-5)),
    )

    def f(
        ctx: RunCtx, x: Any, skip: Any, nw: Any, words: Any, scales: Any, zp: Any = None
    ) -> tuple[Any, ...]:
        return packed_product(
            x, words, scales, zp, k, n, block, silu, (skip, nw, eps), rowwise=is_rowwise(ctx)
        )

    return f


BUILDERS: dict[tuple[str, str], Builder] = {
    (INTERNAL, "Int4Linear"): _int4_linear,
    (INTERNAL, "Int4LinearSiluMul"): _int4_linear_silu_mul,
    (INTERNAL, "RmsInt4Linear"): _rms_int4_linear,
}
