"""One rank's part of an int4 product (com.microsoft MatMulNBits) for the sharding pass (`tp.shard`), cut out
of its packed constants before the lowering dequantizes them (or keeps them packed), so a rank copies and
holds only its part.

MatMulNBits computes `x @ W.T` for `W` `[N, K]` stored per output feature (row) in blocks of `block_size`
along K: B `[N, n_blocks, block / 2]` (uint8, two values a byte), scales `[N * n_blocks]` or
`[N, n_blocks]`, zero points (optional) packed uint8 `[N * ceil(n_blocks / 2)]` (two blocks a byte: re-packed
when a cut starts at an odd block) or one float per block, bias `[N]`, g_idx (only the trivial one, block
`k // block_size` for every k, is accepted: it says nothing).

- `keep_rows`: column-parallel, the output features `rows` of this rank: B's, the scales', the zero points'
  and the bias' rows; `N` becomes the local count.
- `keep_blocks`: row-parallel, the input features of blocks `[ba, bb)`: B's, the scales' and the zero points'
  blocks of every row; `K` becomes the local count (the last block may be partial, as in the whole); the
  bias kept by rank 0 only (the partial sums are added across ranks after the product).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from onnxgen.backends.native.ops import Node, trivial_g_idx
from onnxgen.package.int4 import pack_nibbles, unpack_nibbles

Put = Callable[[str, torch.Tensor], str]  # a new constant of this rank: its name


def is_nbits(n: Node) -> bool:
    return n.domain == "com.microsoft" and n.op == "MatMulNBits"


def dims(n: Node) -> tuple[int, int, int, int]:
    """`(K, N, block, n_blocks)` of a MatMulNBits node."""
    k, nn, block = int(n.attr("K")), int(n.attr("N")), int(n.attr("block_size"))
    return k, nn, block, (k + block - 1) // block


def _inputs(n: Node) -> list[str]:
    return list(n.inputs) + [""] * (6 - len(n.inputs))


def _zp_blocks(zp: torch.Tensor, rows: int, nb: int) -> torch.Tensor:
    """Packed uint8 zero points -> one value per block `[rows, nb]`."""
    return unpack_nibbles(zp.reshape(rows, (nb + 1) // 2).to(torch.uint8), nb)


def keep_rows(n: Node, consts: dict[str, torch.Tensor], put: Put, rows: torch.Tensor) -> None:
    """Column-parallel: `n` computes the output features `rows` (indices into N) only."""
    ins = _inputs(n)
    _, nn, _, nb = dims(n)
    b, sc = consts[ins[1]], consts[ins[2]]
    ins[1] = put(ins[1], b.reshape(nn, nb, -1).index_select(0, rows))
    ins[2] = put(ins[2], _flat_like(sc, sc.reshape(nn, nb).index_select(0, rows)))
    if ins[3]:
        zp = consts[ins[3]]
        ins[3] = put(ins[3], _flat_like(zp, zp.reshape(nn, -1).index_select(0, rows)))
    if ins[5]:
        ins[5] = put(ins[5], consts[ins[5]].reshape(-1).index_select(0, rows))
    n.inputs = _trim(ins)
    n.attrs["N"] = int(rows.numel())


def keep_blocks(n: Node, consts: dict[str, torch.Tensor], put: Put, ba: int, bb: int, rank: int) -> None:
    """Row-parallel: `n` reads the input features of blocks `[ba, bb)` only (a partial sum)."""
    ins = _inputs(n)
    k, nn, block, nb = dims(n)
    assert 0 <= ba < bb <= nb
    b, sc = consts[ins[1]], consts[ins[2]]
    ins[1] = put(ins[1], b.reshape(nn, nb, -1)[:, ba:bb])
    ins[2] = put(ins[2], _flat_like(sc, sc.reshape(nn, nb)[:, ba:bb]))
    if ins[3]:
        zp = consts[ins[3]]
        if zp.dtype == torch.uint8:
            local = pack_nibbles(_zp_blocks(zp, nn, nb)[:, ba:bb].contiguous(), fill=8)
        else:
            local = zp.reshape(nn, nb)[:, ba:bb]
        ins[3] = put(ins[3], _flat_like(zp, local))
    if ins[5] and rank:
        ins[5] = ""  # rank 0 adds the bias once
    n.inputs = _trim(ins)
    n.attrs["K"] = min(bb * block, k) - ba * block


def _flat_like(orig: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`t` (rows first) in `orig`'s layout: flat when `orig` is."""
    return t.reshape(-1) if orig.dim() == 1 else t


def _trim(ins: list[str]) -> list[str]:
    while ins and not ins[-1]:
        ins.pop()
    return ins


def problem(n: Node, consts: dict[str, Any]) -> str | None:
    """Why `n` (a MatMulNBits) cannot be cut, or None: its weights must be constants and its g_idx absent or
    trivial."""
    ins = _inputs(n)
    if not all(x in consts for x in ins[1:4] if x):
        return "its packed weights are not constants"
    if ins[4]:
        k, _, block, _ = dims(n)
        g = consts.get(ins[4])
        if g is None or not trivial_g_idx(g, k, block):
            return "a g_idx that reorders the input features is not sharded"
        n.inputs = _trim([*ins[:4], "", *ins[5:]])  # trivial: says nothing
    return None
