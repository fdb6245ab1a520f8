"""Triton kernel for MatMulNBits executed on its packed int4 weights (imported only when Triton is used).

`int4_linear(x, packed, scales, zero_points, k, n, block)` computes `x @ W.T` where `W` `[N, K]` is
MatMulNBits' B as the model builder writes it: uint8 `[N, n_blocks, block / 2]`, element 2i of a block in
the low nibble of byte i and 2i+1 in the high one; `scales` `[N * n_blocks]`; zero points absent (8),
packed uint8 `[N, ceil(n_blocks / 2)]` (block j's in the low nibble of byte j / 2 when j is even), or one
float per block. Nothing is dequantized in memory: each program reads a tile of packed bytes, expands the
nibbles in registers and accumulates in float32, so the weights' traffic is their packed size (half a byte
per weight plus the scales). One program per (output tile, row of x): meant for the small row counts of
decode steps. Its contract is `ops.quant.dequant_matmul_nbits`'s followed by a MatMul (tested against it
under `TRITON_INTERPRET=1` on the CPU). Used by the lowering's `Int4Linear` with `int4="packed"`
(`ops.quant`); the default still dequantizes at load until this kernel is measured on the GPU (issue 13).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def block_scale_zero(S, Z, rn, blk, km, NB, ZP: tl.constexpr):
    """Scales and zero points (float32) of output rows `rn` `[R]` at quantization blocks `blk` `[B]` ->
    `[R, B]` each (`km` masks both); `ZP` as `zero_point_mode`'s (0: the zero point is 8)."""
    s = tl.load(S + rn[:, None] * NB + blk[None, :], mask=km, other=0.0).to(tl.float32)
    if ZP == 1:
        zb = tl.load(Z + rn[:, None] * ((NB + 1) // 2) + blk[None, :] // 2, mask=km, other=0).to(tl.int32)
        z = tl.where(blk[None, :] % 2 == 0, zb & 0xF, zb >> 4).to(tl.float32)
    elif ZP == 2:
        z = tl.load(Z + rn[:, None] * NB + blk[None, :], mask=km, other=0.0).to(tl.float32)
    else:
        z = tl.zeros_like(s) + 8.0
    return s, z


@triton.jit
def int4_gemv_kernel(X, B, S, Z, Y, K, N, NB, sxm, sym, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCKS: tl.constexpr, ZP: tl.constexpr):  # fmt: skip
    """ZP: 0 none (8), 1 packed uint8 nibbles, 2 one float per block. Each step of the loop takes `BLOCKS`
    quantization blocks of `BLOCK_N` rows: the nibbles' dot products with x are summed per block, then
    scaled once per block (`s * (sum(q * x) - z * sum(x))`)."""
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    HB: tl.constexpr = BLOCK // 2  # bytes per block
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    row_bytes = NB * HB
    rblk = tl.arange(0, BLOCKS)
    rb = tl.arange(0, BLOCKS * HB)  # bytes of this step, block-major
    acc = tl.zeros([BLOCK_N, BLOCKS], dtype=tl.float32)
    xrow = X + m * sxm
    for b0 in range(0, NB, BLOCKS):
        byte_i = b0 * HB + rb  # byte index within a row: elements 2i and 2i + 1
        bmask = (b0 + rb // HB) < NB
        byte = tl.load(B + rn[:, None].to(tl.int64) * row_bytes + byte_i[None, :],
                       mask=nmask[:, None] & bmask[None, :], other=0, eviction_policy="evict_first")  # fmt: skip
        byte = byte.to(tl.int32)
        xe = tl.load(xrow + 2 * byte_i, mask=bmask & (2 * byte_i < K), other=0.0).to(tl.float32)
        xo = tl.load(xrow + 2 * byte_i + 1, mask=bmask & (2 * byte_i + 1 < K), other=0.0).to(tl.float32)
        q = (byte & 0xF).to(tl.float32) * xe[None, :] + (byte >> 4).to(tl.float32) * xo[None, :]
        dot = tl.sum(tl.reshape(q, (BLOCK_N, BLOCKS, HB)), axis=2)  # [BLOCK_N, BLOCKS]
        xsum = tl.sum(tl.reshape(xe + xo, (BLOCKS, HB)), axis=1)  # [BLOCKS]
        blk = b0 + rblk
        km = nmask[:, None] & (blk < NB)[None, :]
        s, z = block_scale_zero(S, Z, rn, blk, km, NB, ZP)
        acc += s * (dot - z * xsum[None, :])
    tl.store(Y + m * sym + rn, tl.sum(acc, axis=1).to(Y.dtype.element_ty), mask=nmask)


def zero_point_mode(zero_points: torch.Tensor | None, scales: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The kernels' `ZP` and the tensor passed for `Z`: 0 none (8; `scales` stands in), 1 packed uint8
    nibbles, 2 one float per block."""
    if zero_points is None:
        return 0, scales
    return (1 if zero_points.dtype == torch.uint8 else 2), zero_points.contiguous()


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None,
                k: int, n: int, block: int, block_n: int = 8, blocks: int | None = None,
                warps: int = 4) -> torch.Tensor:  # fmt: skip
    """`x` `[..., K]` times the packed weights -> `[..., N]` in x's dtype (float32 accumulation). `blocks`:
    quantization blocks per loop step (default: 256 elements' worth)."""
    assert block % 2 == 0 and block & (block - 1) == 0 and packed.dtype == torch.uint8
    nb = (k + block - 1) // block
    if blocks is None:
        blocks = max(1, 256 // block)
    x2 = x.reshape(-1, k).contiguous()
    y = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    zmode, z = zero_point_mode(zero_points, scales)
    grid = (triton.cdiv(n, block_n), x2.shape[0])
    int4_gemv_kernel[grid](x2, packed.contiguous(), scales.contiguous(), z, y, k, n, nb, x2.stride(0), y.stride(0),
                           BLOCK=block, BLOCK_N=block_n, BLOCKS=blocks, ZP=zmode, num_warps=warps)  # fmt: skip
    return y.reshape(*x.shape[:-1], n)
