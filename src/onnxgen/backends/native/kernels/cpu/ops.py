"""Torch-facing calls of the C kernels (`kernels.c`): each returns its result, or None where the kernels do
not apply (not float32 CPU tensors, a layout they do not read, too many rows, the library unavailable), and
the caller runs its torch path. Results match the torch paths up to the summation order inside a dot
product; a row's values never depend on the call's other rows.

- `linear(x, w, ...)`: up to `ROWS` rows of `x @ w` over a `[K, N]` float32 weight or its split layout
  `[P, K, N / P]` (`kernels.cpu_gemm`), with an RMSNorm (and skip sum) before it, a bias, a residual or
  `silu(g) * u` over `[g | u]` after it.
- `rope_qkv_write(...)`: `kernels.attention.rope_qkv_write`'s values (q and k rotated, k and v written).
- `paged_attention(...)` / `buffer_attention(...)`: query tokens over their sequences' keys, in a paged step's
  pages or one sequence's contiguous buffers (`KVRead` says where: `paged_kv`, `buffer_kv`): decode and
  verify steps.
- `Layer`: a whole pre-norm decoder layer in one call (`ops.cpu_layer`).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from typing import Any, NamedTuple

import torch

from onnxgen.backends.native.kernels.cpu.build import library

ROWS = 16  # the most rows a `linear` call computes (og_linear's OG_ROWS_MAX)
QUERY_TOKENS = 16  # the most query tokens per sequence the attention takes here (decode and verify steps)
GROUP_MAX, HEAD_MAX = 64, 256  # query heads per KV head, head size (the C side's bounds)

_F32 = torch.float32
_local = threading.local()


def usable(*xs: torch.Tensor | None) -> bool:
    """Whether every given tensor is float32 on the CPU and the library runs here."""
    return all(x is None or (x.device.type == "cpu" and x.dtype == torch.float32) for x in xs) and (
        library() is not None
    )


def _ptr(x: torch.Tensor | None) -> int | None:
    return None if x is None else x.data_ptr()


def _scratch(n: int, use: str) -> torch.Tensor:
    """A float32 buffer of at least n elements kept per thread and `use` (the kernels' working memory: a
    call's results never live in it)."""
    key = "scratch_" + use
    buf = getattr(_local, key, None)
    if buf is None or buf.numel() < n:
        buf = torch.empty(max(n, 1 << 16), dtype=torch.float32)
        setattr(_local, key, buf)
    return buf


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    silu_halves: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """`(act(h @ w + bias + residual), sum)`, h = x or with `norm` = (skip, weight, eps) `rms_norm(x, skip)`'s
    output (sum: `x + skip`, None without skip); `silu_halves`: `silu(g) * u` of the product's halves (not
    with bias or residual). w: `[K, N]` or the split `[P, K, N / P]`, contiguous. None: not taken here."""
    lib = library()
    if lib is None or x.dtype is not _F32 or w.dtype is not _F32 or x.device.type != "cpu":
        return None
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not 1 <= rows <= ROWS or not x.is_contiguous():
        return None
    weight = _weight(w, k)
    if weight is None:
        return None
    n = weight.parts * weight.nb
    skip, nw, eps = norm if norm is not None else (None, None, 0.0)
    if silu_halves and (bias is not None or residual is not None or n % 2):
        return None
    for t, size in ((skip, rows * k), (nw, k), (bias, n), (residual, rows * n)):
        if t is not None and (t.dtype is not _F32 or not t.is_contiguous() or t.numel() != size):
            return None
    scratch = _scratch((rows * k if nw is not None else 0) + (rows * n if silu_halves else 0), "linear")
    s = torch.empty_like(x) if skip is not None else None
    out = torch.empty(*x.shape[:-1], n // 2 if silu_halves else n)
    y = scratch[rows * k :] if nw is not None else scratch  # the whole product under silu_halves
    rc = lib.og_linear(
        x.data_ptr(), rows, k, _ptr(skip), _ptr(nw), float(eps), scratch.data_ptr(), _ptr(s),
        ctypes.byref(weight), _ptr(bias), _ptr(residual), int(silu_halves),
        y.data_ptr() if silu_halves else out.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    assert rc == 0, f"og_linear refused rows={rows} K={k} parts={weight.parts} nb={weight.nb}"
    return out, s


def rope_qkv_write(
    qkv: torch.Tensor,
    cos_c: torch.Tensor,
    sin_c: torch.Tensor,
    positions: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    n: int,
    hkv: int,
    d: int,
    interleaved: bool,
    slots: torch.Tensor,
    token_major: bool,
) -> torch.Tensor | None:
    """`kernels.attention.rope_qkv_write` without q/k norms: packed QKV `[1, S, (n + 2 hkv) d]` -> rotated q
    `[1, n, S, d]` (a view of `[1, S, n, d]` storage when `token_major`); rotated k and v written into
    `keys` / `values` (`[1, hkv, rows, d]`, any head and row strides) at rows `slots`. None: not taken."""
    s = qkv.shape[1]
    half = cos_c.shape[1]
    if (
        not usable(qkv, cos_c, sin_c, keys, values)
        or qkv.stride(-1) != 1
        or qkv.stride(1) < qkv.shape[2]
        or cos_c.stride(1) != 1
        or cos_c.stride() != sin_c.stride()
        or keys.stride(-1) != 1
        or keys.stride() != values.stride()
        or 2 * half > d
        or positions.dtype != torch.int64
        or slots.dtype != torch.int64
    ):
        return None
    positions, slots = positions.contiguous(), slots.contiguous()
    qout = torch.empty((1, s, n, d) if token_major else (1, n, s, d))
    q = qout.transpose(1, 2) if token_major else qout  # [1, n, S, d] either way
    rc = library().og_rope_qkv_write(  # type: ignore[union-attr]
        qkv.data_ptr(), qkv.stride(1), s, n, hkv, d, half, cos_c.data_ptr(), sin_c.data_ptr(), cos_c.stride(0),
        positions.data_ptr(), slots.data_ptr(), int(interleaved), q.data_ptr(), q.stride(2), q.stride(1),
        keys.data_ptr(), values.data_ptr(), keys.stride(2), keys.stride(1),
    )  # fmt: skip
    assert rc == 0
    return q


def most_tokens(ps: Any) -> int:
    """The most query tokens any sequence of a paged step (`paged.PagedStep`) holds (1: a decode step)."""
    return max((b - a for a, b in itertools.pairwise(ps.q_starts)), default=0)


def token_seq(ps: Any) -> torch.Tensor:
    """Each token's sequence index in a paged step (`[T]` int32), made once and kept by the step."""
    if ps._token_seq is None:
        q = ps.q_starts
        ps._token_seq = torch.tensor(
            [b for b in range(len(q) - 1) for _ in range(q[b + 1] - q[b])], dtype=torch.int32
        )
    return ps._token_seq


class KVRead(NamedTuple):
    """Where a call's query tokens find their keys: a layer's keys and values (the same strides), its heads, how
    a key's position maps to memory (page p, row r: `tables[seq[t]][p] * page_stride + r * row_stride`, head h
    at `h * head_stride`; a contiguous buffer is one page of all its rows, page stride 0), each token's
    sequence `seq` (`[T]` int32)."""

    keys: torch.Tensor
    values: torch.Tensor
    hkv: int
    page_stride: int
    row_stride: int
    head_stride: int
    page_size: int
    tables: torch.Tensor
    seq: torch.Tensor


def paged_kv(ps: Any, layer: int) -> KVRead | None:
    """`layer`'s pages of a paged step (`paged.PagedStep`: `[pages, page_size, Hkv, D]`, its page table and
    each token's sequence), or None where the kernels do not read them."""
    keys, values = ps.storage.keys(layer), ps.storage.values(layer)
    table = ps.page_table
    if (
        keys.dim() != 4
        or not _readable(keys, values)
        or table.dtype != torch.int32
        or not table.is_contiguous()
    ):
        return None
    return KVRead(keys, values, keys.shape[2], keys.stride(0), keys.stride(1), keys.stride(2), keys.shape[1],
                  table, token_seq(ps))  # fmt: skip


def buffer_kv(keys: torch.Tensor, values: torch.Tensor, tokens: int) -> KVRead | None:
    """One sequence's contiguous buffers (`[1, Hkv, rows, D]`, any strides) read by `tokens` query tokens, or
    None where the kernels do not read them."""
    if keys.dim() != 4 or keys.shape[0] != 1 or not _readable(keys, values):
        return None
    return KVRead(keys, values, keys.shape[1], 0, keys.stride(2), keys.stride(1), keys.shape[2], _zero_table(),
                  _zeros(tokens))  # fmt: skip


def _readable(keys: torch.Tensor, values: torch.Tensor) -> bool:
    return usable(keys, values) and keys.stride(-1) == 1 and keys.stride() == values.stride()


def heads_fit(n: int, hkv: int, d: int) -> bool:
    """Whether the attention takes `n` query heads over `hkv` KV heads of size `d` (og_attention's bounds)."""
    return n % hkv == 0 and n // hkv <= GROUP_MAX and d <= HEAD_MAX and d % 8 == 0


def paged_attention(
    q: torch.Tensor, ps: Any, layer: int, scale: float, softcap: float, window: int, sink: torch.Tensor | None
) -> torch.Tensor | None:
    """`q` `[T, N, D]` (the step's tokens, at `ps.positions`) over their sequences' keys in `layer`'s pages:
    causal, from the window's first key with `window` > 0, soft-capped, `sink` (`[N]` float32) in each head's
    denominator. Returns `[T, N, D]` float32, or None: not taken here."""
    kv = paged_kv(ps, layer)
    return None if kv is None else _attention(q, kv, ps.positions, scale, softcap, window, sink)


def buffer_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    softcap: float,
    window: int,
    sink: torch.Tensor | None,
) -> torch.Tensor | None:
    """`paged_attention` over one sequence's contiguous buffers (`[1, Hkv, rows, D]`, any strides): q `[T, N,
    D]`, token t at `positions[t]`."""
    kv = buffer_kv(keys, values, q.shape[0])
    return None if kv is None else _attention(q, kv, positions, scale, softcap, window, sink)


def _zero_table() -> torch.Tensor:
    t = getattr(_local, "zero_table", None)
    if t is None:
        t = _local.zero_table = torch.zeros(1, 1, dtype=torch.int32)
    return t


def _zeros(n: int) -> torch.Tensor:
    z = getattr(_local, "zeros", None)
    if z is None or z.numel() < n:
        z = _local.zeros = torch.zeros(max(n, 64), dtype=torch.int32)
    return z[:n]


def _attention(
    q: torch.Tensor,
    kv: KVRead,
    positions: torch.Tensor,
    scale: float,
    softcap: float,
    window: int,
    sink: torch.Tensor | None,
) -> torch.Tensor | None:
    t, n, d = q.shape
    if (
        not usable(q, sink)
        or q.stride(-1) != 1
        or not heads_fit(n, kv.hkv, d)
        or positions.dtype != torch.int64
        or (sink is not None and (sink.numel() != n or not sink.is_contiguous()))
    ):
        return None
    lib = library()
    assert lib is not None
    positions = positions.contiguous()
    out = torch.empty(t, n, d)
    scratch = _scratch(lib.og_attention_scratch(t, n, d), "attention")
    rc = lib.og_attention(
        q.data_ptr(), q.stride(0), q.stride(1), t, n, kv.hkv, d, kv.keys.data_ptr(), kv.values.data_ptr(),
        kv.page_stride, kv.row_stride, kv.head_stride, kv.tables.data_ptr(), kv.tables.stride(0), kv.page_size,
        kv.seq.data_ptr(), positions.data_ptr(), float(scale), float(softcap), int(window), _ptr(sink),
        out.data_ptr(), out.stride(0), out.stride(1), scratch.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    assert rc == 0
    return out


class _Weight(ctypes.Structure):
    _fields_ = [
        ("w", ctypes.c_void_p),
        ("parts", ctypes.c_int),
        ("block_stride", ctypes.c_int64),
        ("ldw", ctypes.c_int64),
        ("nb", ctypes.c_int),
    ]


class _LayerArgs(ctypes.Structure):
    """`og_layer_args` (kernels.c), field for field."""

    _fields_ = [
        ("x", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("rows", ctypes.c_int),
        ("K", ctypes.c_int),
        ("nw1", ctypes.c_void_p),
        ("nw2", ctypes.c_void_p),
        ("eps1", ctypes.c_float),
        ("eps2", ctypes.c_float),
        ("wqkv", _Weight),
        ("wo", _Weight),
        ("wgu", _Weight),
        ("wdown", _Weight),
        ("n", ctypes.c_int),
        ("hkv", ctypes.c_int),
        ("d", ctypes.c_int),
        ("half", ctypes.c_int),
        ("interleaved", ctypes.c_int),
        ("cos_c", ctypes.c_void_p),
        ("sin_c", ctypes.c_void_p),
        ("cs", ctypes.c_int64),
        ("rope_rows", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        ("kb", ctypes.c_void_p),
        ("vb", ctypes.c_void_p),
        ("kv_row", ctypes.c_int64),
        ("kv_head", ctypes.c_int64),
        ("page_stride", ctypes.c_int64),
        ("tables", ctypes.c_void_p),
        ("table_stride", ctypes.c_int64),
        ("page_size", ctypes.c_int),
        ("seq", ctypes.c_void_p),
        ("pos", ctypes.c_void_p),
        ("scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
        ("window", ctypes.c_int),
        ("sink", ctypes.c_void_p),
        ("scratch", ctypes.c_void_p),
        ("nthreads", ctypes.c_int),
    ]


def _weight(w: torch.Tensor, k: int) -> _Weight | None:
    """A product weight as `og_weight` (`[K, N]` or the split `[P, K, N / P]`, contiguous float32), or None."""
    if w.dtype is not _F32 or w.device.type != "cpu" or not w.is_contiguous() or w.shape[-2] != k:
        return None
    if w.dim() == 3:
        return _Weight(w.data_ptr(), w.shape[0], k * w.shape[2], w.shape[2], w.shape[2])
    if w.dim() == 2:
        return _Weight(w.data_ptr(), 1, 0, w.shape[1], w.shape[1])
    return None


class Layer:
    """A pre-norm decoder layer with packed QKV, rotary attention and a SiLU-gated MLP run by one C call
    (`og_layer`) for up to `ROWS` tokens: the values of the separate calls `linear` (norm + QKV),
    `rope_qkv_write`, `paged_attention` / `buffer_attention`, `linear` (output product + residual), `linear`
    (norm + gate/up + SiLU) and `linear` (down product + residual), in one parallel region.

    `Layer.make(...)` returns None where the constants are not for the kernels (the caller keeps the separate
    ops); `run(...)` returns the layer's output, or None where a step is not for them."""

    def __init__(self, args: _LayerArgs, keep: tuple[torch.Tensor, ...], ngu: int) -> None:
        self._template = args  # the constants' fields; each thread fills its own copy's step fields
        self._local = threading.local()  # a program is shared: decoders on other threads run it too
        self._keep = keep  # the constants the struct points into
        self._ngu = ngu

    def _args(self) -> _LayerArgs:
        a = getattr(self._local, "args", None)
        if a is None:
            a = self._local.args = _LayerArgs.from_buffer_copy(self._template)
        return a

    @classmethod
    def make(
        cls,
        *,
        nw1: torch.Tensor,
        eps1: float,
        wqkv: torch.Tensor,
        wo: torch.Tensor,
        nw2: torch.Tensor,
        eps2: float,
        wgu: torch.Tensor,
        wdown: torch.Tensor,
        heads: tuple[int, int, int],
        cos_c: torch.Tensor,
        sin_c: torch.Tensor,
        interleaved: bool,
        scale: float,
        softcap: float,
        window: int,
        sink: torch.Tensor | None,
    ) -> Layer | None:
        if library() is None:
            return None
        n, hkv, d = heads
        k = nw1.numel()
        ws = (_weight(wqkv, k), _weight(wo, n * d), _weight(wgu, k))
        if any(w is None for w in ws) or wgu.numel() % (2 * k):
            return None
        ngu = wgu.numel() // k
        down = _weight(wdown, ngu // 2)
        consts = [nw1, nw2, cos_c, sin_c, *([sink] if sink is not None else [])]
        if (
            down is None
            or any(t.dtype is not _F32 or t.device.type != "cpu" or not t.is_contiguous() for t in consts)
            or nw2.numel() != k
            or not heads_fit(n, hkv, d)
            or 2 * cos_c.shape[1] > d
            or cos_c.stride() != sin_c.stride()
            or (sink is not None and sink.numel() != n)
        ):
            return None
        if (
            ws[0].parts * ws[0].nb != (n + 2 * hkv) * d
            or ws[1].parts * ws[1].nb != k
            or down.parts * down.nb != k
        ):
            return None
        args = _LayerArgs()
        args.K, args.nw1, args.nw2, args.eps1, args.eps2 = k, nw1.data_ptr(), nw2.data_ptr(), eps1, eps2
        args.wqkv, args.wo, args.wgu, args.wdown = ws[0], ws[1], ws[2], down
        args.n, args.hkv, args.d, args.half, args.interleaved = n, hkv, d, cos_c.shape[1], int(interleaved)
        args.cos_c, args.sin_c, args.cs = cos_c.data_ptr(), sin_c.data_ptr(), cos_c.stride(0)
        args.scale, args.softcap, args.window = scale, softcap, window
        args.sink = _ptr(sink)
        keep = (nw1, wqkv, wo, nw2, wgu, wdown, cos_c, sin_c, *([sink] if sink is not None else []))
        return cls(args, keep, ngu)

    def run_paged(self, x: torch.Tensor, rope_rows: torch.Tensor, ps: Any, layer: int) -> torch.Tensor | None:
        """The layer over a paged step (`paged.PagedStep`, at most `QUERY_TOKENS` tokens of any sequence):
        k and v written at the step's slots in `layer`'s pages, each token attending over its sequence's."""
        kv = paged_kv(ps, layer)
        return None if kv is None else self._run(x, rope_rows, ps.slots, ps.positions, kv)

    def run_buffer(
        self,
        x: torch.Tensor,
        rope_rows: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> torch.Tensor | None:
        """The layer over one sequence's contiguous KV buffers (`[1, Hkv, capacity, D]`): its tokens at
        `positions`, k and v written there."""
        kv = buffer_kv(keys, values, positions.numel())
        return None if kv is None else self._run(x, rope_rows, positions, positions, kv)

    def _run(
        self, x: torch.Tensor, rope_rows: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, kv: KVRead
    ) -> torch.Tensor | None:
        a = self._args()
        rows = x.numel() // a.K
        if (
            not 1 <= rows <= ROWS
            or x.dtype is not _F32
            or not x.is_contiguous()
            or rope_rows.dtype != torch.int64
            or slots.dtype != torch.int64
            or pos.dtype != torch.int64
            or pos.numel() != rows
            or kv.hkv != a.hkv
        ):
            return None
        lib = library()
        if lib is None:  # switched off since this layer was made
            return None
        rope_rows, slots, pos = rope_rows.contiguous(), slots.contiguous(), pos.contiguous()
        out = torch.empty_like(x)
        scratch = _scratch(lib.og_layer_scratch(rows, a.K, a.n, a.hkv, a.d, self._ngu), "layer")
        a.x, a.out, a.rows = x.data_ptr(), out.data_ptr(), rows
        a.rope_rows, a.slots, a.pos = rope_rows.data_ptr(), slots.data_ptr(), pos.data_ptr()
        a.kb, a.vb, a.kv_row, a.kv_head = (
            kv.keys.data_ptr(),
            kv.values.data_ptr(),
            kv.row_stride,
            kv.head_stride,
        )
        a.page_stride, a.page_size = kv.page_stride, kv.page_size
        a.tables, a.table_stride, a.seq = kv.tables.data_ptr(), kv.tables.stride(0), kv.seq.data_ptr()
        a.scratch, a.nthreads = scratch.data_ptr(), torch.get_num_threads()
        rc = lib.og_layer(ctypes.byref(a))
        assert rc == 0, f"og_layer refused ({rc}) rows={rows}"
        return out
