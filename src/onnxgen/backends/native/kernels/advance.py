"""The tail of a captured decode step, and the page copy of copy-on-write.

`decode_advance` / `greedy_advance` move a decode graph's inputs on to the next step on the device (its
buffers' layout: `native.step_buffers`), so that the runner's next replay needs no host work;
`copy_page_prefix` copies a partial page in every layer of the paged pool in one launch.
"""

from __future__ import annotations

import torch

import onnxgen.envs as envs
from onnxgen.backends.native.kernels.dispatch import KERNELS, launch_options, triton_cdiv, use_triton
from onnxgen.backends.native.kernels.reference import decode_advance_ref


def decode_advance(
    top: torch.Tensor,
    wide: torch.Tensor,
    narrow: torch.Tensor,
    toks: torch.Tensor,
    batch: int,
    max_pages: int,
    page: int,
) -> None:
    """The tail of a captured decode step of `batch` rows, so that the next replay is the next decode step
    with no host work: for each live row r (`wide[4B + 1]` of them) the step's chosen token `top[r]`
    becomes its next token id and is recorded in `toks[count % len(toks), r]` (`count` = `wide[4B]`,
    then incremented), its position moves on by one, its slot is looked up in its page-table row and its
    KV length grows by one. `wide` is the graph's int64 `[ids B, positions B, slots B, rows B, count,
    live]`, `narrow` its int32 `[lengths B, page table B x max_pages, ...]`. Rows past `live` (padding)
    are left alone. One launch, on a Triton device; `decode_advance_ref` elsewhere."""
    if not use_triton(top):
        decode_advance_ref(top, wide, narrow, toks, batch, max_pages, page)
        return
    # pragma: cuda-begin (Triton launch: CUDA, or the Triton interpreter)
    KERNELS["decode_advance"][(1,)](
        top,
        top,
        wide,
        narrow,
        toks,
        batch,
        max_pages,
        toks.shape[0],
        1,
        PAGE=page,
        BLOCK=max(16, 1 << (batch - 1).bit_length()),
        PART=False,
        CP=1,
        num_warps=4,
        **launch_options(top),
    )
    # pragma: cuda-end


ARGMAX_BLOCK = 4096  # columns per partial maximum


def greedy_advance(
    logits: torch.Tensor,
    wide: torch.Tensor,
    narrow: torch.Tensor,
    toks: torch.Tensor,
    batch: int,
    max_pages: int,
    page: int,
) -> None:
    """`decode_advance(logits.argmax(-1), ...)` for `[batch, V]` logits: each row's token is its first maximum
    (`torch.argmax`'s choice, ties to the first column). On a Triton device with `ONNXGEN_GREEDY_IN_ADVANCE`
    (the default; read per call) the choice takes two launches that both take part in programmatic dependent
    launch, unlike `torch.argmax`'s one-block reduction: partial maxima per block of `ARGMAX_BLOCK` columns,
    then each row's pick inside `decode_advance`'s launch (docs/benchmarks/decode-gpu.md)."""
    if not (use_triton(logits) and envs.read("GREEDY_IN_ADVANCE")):
        decode_advance(logits.argmax(-1), wide, narrow, toks, batch, max_pages, page)
        return
    # pragma: cuda-begin (Triton launch: CUDA, or the Triton interpreter)
    rows, v = logits.shape
    assert rows == batch and logits.stride(1) == 1
    c = triton_cdiv(v, ARGMAX_BLOCK)
    pv = torch.empty((rows, c), dtype=torch.float32, device=logits.device)
    pi = torch.empty((rows, c), dtype=torch.int32, device=logits.device)
    KERNELS["argmax_part"][(rows, c)](
        logits, pv, pi, v, logits.stride(0), c, BLOCK=ARGMAX_BLOCK, num_warps=4, **launch_options(logits)
    )
    KERNELS["decode_advance"][(1,)](
        pi,
        pv,
        wide,
        narrow,
        toks,
        batch,
        max_pages,
        toks.shape[0],
        c,
        PAGE=page,
        BLOCK=max(16, 1 << (batch - 1).bit_length()),
        PART=True,
        CP=max(2, 1 << (c - 1).bit_length()),
        num_warps=4,
        **launch_options(logits),
    )
    # pragma: cuda-end


def copy_page_prefix(data: torch.Tensor, src: int, dst: int, n: int) -> None:
    """Copy positions [0, n) of page `src` into page `dst` in every layer of a pool tensor `data`
    (`[layers, 2, pages, page_size, kv_heads, head_dim]`, `PageStorage.data`): one launch on a Triton device
    (a strided torch copy of a pool past 2^31 elements is split into a launch per layer), a slice copy
    elsewhere."""
    if not use_triton(data):
        data[:, :, dst, :n].copy_(data[:, :, src, :n])
        return
    # pragma: cuda-begin (Triton launch: CUDA, or the Triton interpreter)
    assert data.is_contiguous()
    elems = n * data.stride(3)
    block = 1024
    KERNELS["copy_prefix"][(data.shape[0] * 2, triton_cdiv(elems, block))](
        data,
        src,
        dst,
        data.stride(1),
        data.stride(2),
        elems,
        BLOCK=block,
        num_warps=4,
        **launch_options(data),
    )
    # pragma: cuda-end
