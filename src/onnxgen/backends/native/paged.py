"""Attention over the paged KV pool for a flattened ragged batch (`onnxgen.backends.batch.BatchStep`).

`PagedStep` is one step's attention metadata on the device, built once per step and read by every
attention op through `RunCtx.paged`:

    tokens      t0 t1 t2 | t3 | t4 t5            (T = 6 flattened tokens, B = 3 sequences)
    q_starts    0        3    4      6
    seq_lens    3        131  2                  (KV length of each sequence after this step)
    positions   0  1  2  130  0  1
    slots       page_table[b][p // P] * P + p % P   for each token's position p

`write_kv` stores the step's keys and values at their slots; `attention` attends each token over its
own sequence's positions `[0, p]` (bottom-right causal; `window` > 0 keeps the last `window`). The torch
path below is the reference (CPU, and the ground truth for the GPU kernels): per sequence, gather its
pages into contiguous keys and values and compute in float32, rounding the output once.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

import onnxgen.envs as envs
from onnxgen.backends.batch import BatchStep
from onnxgen.backends.native.kernels.cpu import ops as cpu_kernels
from onnxgen.backends.native.kernels.dispatch import launch_options, use_triton
from onnxgen.backends.native.kernels.reference import softmax_with_sink


@dataclass
class PagedStep:
    storage: Any  # onnxgen.kv.storage.PageStorage
    page_size: int
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64
    last: torch.Tensor  # [R] int64: flattened index of each logits row's token
    page_table: torch.Tensor  # [B, max pages] int32 (rows padded with page 0)
    q_starts_t: torch.Tensor  # [B + 1] int32
    seq_lens_t: torch.Tensor  # [B] int32
    q_starts: list[int]  # the same on the host
    seq_lens: list[int]  # (captured steps: the context, so the key splits are planned for any length)
    # the KV length the key splits are planned for (0: the longest of `seq_lens`); steps of one token per
    # sequence plan for the whole context, so a sequence's attention is the same eager or captured
    plan_len: int = 0
    # every token its own work item, attended exactly as a one-token step of its sequence would (the decode
    # tile, a batch-1 decode's key splits): a verify step whose rows must equal plain decoding's bits
    per_token: bool = False
    _work: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    _tables: list[Sequence[int]] | None = None
    _token_seq: torch.Tensor | None = None  # each token's sequence (`kernels.cpu.ops.token_seq`)

    @property
    def num_tokens(self) -> int:
        return self.q_starts[-1]

    def pages_of(self, b: int) -> Sequence[int]:
        """Sequence `b`'s page table on the host: the step's own lists, else `page_table` read back once."""
        if self._tables is None:
            self._tables = self.page_table.tolist()
        return self._tables[b]

    def work(self, group: int, block_m: int) -> torch.Tensor:
        """`[W, 3]` int32 work items (sequence, first row, end row) for a kernel that takes up to `block_m`
        rows of `group` query heads x tokens at a time (`per_token`: each token's `group` rows on their own,
        cut as a one-token step cuts them)."""
        key = (group, block_m)
        if key not in self._work:
            items = []
            for b in range(len(self.seq_lens)):
                rows = group * (self.q_starts[b + 1] - self.q_starts[b])
                if self.per_token:
                    items += [
                        (b, t + j, t + min(j + block_m, group))
                        for t in range(0, rows, group)
                        for j in range(0, group, block_m)
                    ]
                else:
                    items += [(b, r, min(r + block_m, rows)) for r in range(0, rows, block_m)]
            self._work[key] = torch.tensor(items, dtype=torch.int32).to(self.positions.device)
        return self._work[key]


def build_step(step: BatchStep, storage: Any, page_size: int, device: torch.device) -> PagedStep:
    """Device metadata of `step`: two host-to-device copies (an int64 and an int32 vector)."""
    positions: list[int] = []
    slots: list[int] = []
    q_starts = [0]
    seq_lens: list[int] = []
    last: list[int] = []
    tables: list[Sequence[int]] = []
    for s in step.seqs:
        n = len(s.tokens)
        assert n > 0 and s.start >= 0, "every chunk feeds at least one token"
        need = -(-s.end // page_size)
        assert len(s.pages) >= need, f"{len(s.pages)} pages do not cover {s.end} positions"
        pages = s.pages
        assert min(pages[s.start // page_size : need]) >= 0, "a chunk writes into a page given back"
        positions.extend(range(s.start, s.end))
        slots.extend(pages[p // page_size] * page_size + p % page_size for p in range(s.start, s.end))
        q_starts.append(q_starts[-1] + n)
        seq_lens.append(s.end)
        rows = int(s.logits)
        assert rows <= n, f"{rows} rows of logits from a chunk of {n} tokens"
        last.extend(range(q_starts[-1] - rows, q_starts[-1]))
        tables.append(pages[:need])
    t, r, b = len(positions), len(last), len(tables)
    wide = torch.tensor([*positions, *slots, *last], dtype=torch.int64).to(device, non_blocking=True)
    maxp = max(len(x) for x in tables)
    flat = [p for x in tables for p in (*x, *([0] * (maxp - len(x))))]
    narrow = torch.tensor([*flat, *q_starts, *seq_lens], dtype=torch.int32).to(device, non_blocking=True)
    return PagedStep(
        storage,
        page_size,
        wide[:t],
        wide[t : 2 * t],
        wide[2 * t : 2 * t + r],
        narrow[: b * maxp].view(b, maxp),
        narrow[b * maxp : b * maxp + b + 1],
        narrow[b * maxp + b + 1 :],
        q_starts,
        seq_lens,
        _tables=tables,
    )


class PoolRows:
    """The pool as per-layer `[1, kv_heads, rows, head_dim]` buffers whose rows are slots: what
    `kernels.attention.rope_qkv_write` (given the step's slots) writes a step's rotated keys and values
    into."""

    def __init__(self, storage: Any) -> None:
        views = [storage.rows(layer) for layer in range(storage.num_layers)]
        self.keys = [k for k, _ in views]
        self.values = [v for _, v in views]

    def write_at(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write `k`/`v` (`[1, kv_heads, T, head_dim]`) at rows `index` (`[T]` int64)."""
        self.keys[layer].index_copy_(2, index, k)
        self.values[layer].index_copy_(2, index, v)


def write_kv(ps: PagedStep, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store `k`/`v` (`[T, kv_heads, head_dim]`) at the step's slots in layer `layer`."""
    ps.storage.write(layer, ps.slots, k, v)


def attention(
    ps: PagedStep,
    layer: int,
    q: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
    window: int = -1,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """`q` `[T, N, D]` (the step's tokens, already rotated) over each sequence's KV (which already holds
    this step's keys). `sink`: `[N]` float32, one more logit per head in the softmax's denominator
    (`ops.attention.softmax_with_sink`). Returns `[T, N, D]` in q's dtype. Triton on CUDA (and under
    `FORCE_TRITON`), the torch reference elsewhere."""
    if use_triton(q):
        return attention_triton(ps, layer, q, scale, softcap, window, sink=sink)
    if cpu_kernels.most_tokens(ps) <= cpu_kernels.QUERY_TOKENS:  # decode and verify steps
        o = cpu_kernels.paged_attention(q, ps, layer, scale, softcap, window, sink)
        if o is not None:
            return o
    return attention_ref(ps, layer, q, scale, softcap, window, sink)


_LOG2E = 1.4426950408889634
_MAX_SPLITS = 32
Tile = tuple[
    int, int, int, int
]  # rows per program (BLOCK_M), keys per block (BLOCK_N), warps, pipeline stages


LARGE_ROWS = 64  # work items of more query rows (prefill chunks) may take the large tile


def tile_for(rows: int, fewest: int, group: int, d: int, fp32: bool = False) -> Tile:
    """The attention kernel's tile for a step whose sequences feed `fewest`..`rows` query rows (`group` query
    heads per KV head x tokens) of head size `d`: decode-size items take 16..64 rows of 64 keys (4 warps);
    a step of prefill chunks only (more than `LARGE_ROWS` rows each) takes 128 x 128 with 8 warps, 3 stages
    deep (faster than 64 x 64 and than PyTorch's flash attention on the 8B shape). A step that mixes decodes with chunks keeps the decode tile: a
    128-row tile would compute 4-row decodes 32 times over. float32 (`fp32`, IEEE products) always takes
    64 x 64, 2 stages: a 32-row fp32 tile with a sliding window computed wrong scores on the GPU
    (`tests/kernels/test_paged_attention.py`, window 8), and 128 x 128 x 3 stages of fp32 overflows shared
    memory at d = 128."""
    if fp32:
        return 64, 64 if d <= 128 else 32, 4, 2
    if fewest > LARGE_ROWS and d <= 128:
        return 128, 128, 8, 3
    return (
        min(64, max(16, 1 << (rows - 1).bit_length())),
        64 if d <= 128 else 32,
        4,
        2 if rows <= group else 3,
    )


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """The device's multiprocessor count (132 off CUDA, the H100's and H200's: the interpreter plans as the
    GPU does)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def splits_for(items: int, longest: int, block_m: int, device: torch.device) -> int:
    """Key splits for `items` (work items x KV heads) over `longest` keys: about two waves of decode-size
    programs (two fit on a multiprocessor), one wave of prefill-size ones (one fits), at least 256 keys each."""
    sms = _multiprocessors(device)
    if block_m <= 64:  # two programs per multiprocessor: about two waves
        n = -(-2 * sms // items)
    else:  # one per multiprocessor: one wave, never a ragged second one
        n = sms // items
    return max(1, min(n, longest // 256, _MAX_SPLITS))


def short_blocks() -> int:
    """Decode-size work items (one token's query rows) whose key splits hold at most this many key blocks at
    the longest KV length a launch may see (`PagedStep.seq_lens`: a captured step's bound) run the attention
    with one software-pipeline stage instead of two: the same bits, less latency for splits of one or two
    blocks; longer splits keep the pipeline (docs/benchmarks/decode-gpu.md).
    `ONNXGEN_SHORT_BLOCKS` (default 2; 0: always pipelined), read at each launch and when a runner plans its
    short-context graphs."""
    return envs.read("SHORT_BLOCKS")


def plan_splits(
    items: int, plan: int, block_m: int, block_n: int, device: torch.device, nsplit: int | None = None
) -> int:
    """The key splits of an attention launch over `plan` keys: `nsplit`, or by default `splits_for`'s count,
    made whole key blocks each and none empty at the plan's length. A work item cuts its own keys into that
    many parts (on the device, from its own length)."""
    n = splits_for(items, plan, block_m, device) if nsplit is None else nsplit
    per = -(-plan // n)
    split = -(-per // block_n) * block_n  # whole key blocks
    return -(-plan // split)


def _short_limit(nsplit: int, block_n: int) -> int:
    """The most keys whose `nsplit` splits (a sequence cuts `ceil(keys / nsplit)` keys a split) each hold at
    most `short_blocks()` blocks of `block_n` keys."""
    return short_blocks() * block_n * nsplit


def is_short(longest: int, nsplit: int, block_n: int) -> bool:
    """Whether every one of `nsplit` key splits of up to `longest` keys holds at most `short_blocks()`
    blocks."""
    return longest <= _short_limit(nsplit, block_n)


def short_keys(items: int, group: int, d: int, plan: int, device: torch.device) -> int:
    """The longest KV length up to which a decode step of `items` (sequences x KV heads) runs its attention
    unpipelined (`is_short`), with the decode tile of `group` query heads of size `d` (half precision)."""
    block_m, block_n, _, _ = tile_for(group, group, group, d)
    return min(plan, _short_limit(plan_splits(items, plan, block_m, block_n, device), block_n))


def attention_triton(
    ps: PagedStep,
    layer: int,
    q: torch.Tensor,
    scale: float,
    softcap: float = 0.0,  # pragma: cuda
    window: int = -1,
    nsplit: int | None = None,
    tile: Tile | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton path of `attention`. `nsplit` (tests, benchmarks): the number of key splits; by default
    `splits_for`'s over `ps.plan_len` (a captured step's host shapes: the whole context). Each work item
    splits its own keys (the longest of its rows) into `nsplit` parts of whole key blocks, on the device:
    a sequence's split depends on its own length only. `tile` (benchmarks): the kernel's tile instead of
    `tile_for`'s. Several splits: their partial results go to scratch buffers and a second launch
    (`kernels/triton/paged.py`'s `paged_combine_kernel`) merges them into the output."""
    from onnxgen.backends.native.kernels.triton import paged as tp

    kpool, vpool = ps.storage.keys(layer), ps.storage.values(layer)
    _, n, d = q.shape
    hkv = kpool.shape[2]
    g = n // hkv
    rows = [g if ps.per_token else g * (b - a) for a, b in zip(ps.q_starts, ps.q_starts[1:], strict=False)]
    block_m, block_n, warps, stages = tile or tile_for(max(rows), min(rows), g, d, q.dtype == torch.float32)
    dp = max(16, 1 << (d - 1).bit_length())
    work = ps.work(g, block_m)
    w = work.shape[0]
    plan = ps.plan_len or max(ps.seq_lens)
    longest = max(ps.seq_lens)
    if window > 0:  # an item reads the keys of its rows' windows only: at most window + tokens - 1
        span = window - 1 + (1 if ps.per_token else max(rows) // g)
        plan, longest = min(plan, span), min(longest, span)
    # per token: planned as one decode (one item per KV head)
    nsplit = plan_splits((1 if ps.per_token else w) * hkv, plan, block_m, block_n, q.device, nsplit)
    decode_size = max(rows) <= g and q.dtype != torch.float32
    if tile is None and decode_size and is_short(longest, nsplit, block_n):
        stages = 1  # decode-size items, short splits: no software pipeline (`short_blocks`)
    qc = q.contiguous()
    out = torch.empty_like(qc)
    direct = nsplit == 1
    acc = qc if direct else torch.empty((w, hkv, nsplit, block_m, dp), dtype=torch.float32, device=q.device)
    ml = qc if direct else torch.empty((w, hkv, nsplit, block_m, 2), dtype=torch.float32, device=q.device)
    one = ps.num_tokens == len(ps.seq_lens) and g <= block_m  # item b: sequence b's one token, rows 0..g
    tp.paged_attn_kernel[(w, hkv, nsplit)](
        qc,
        kpool,
        vpool,
        ps.page_table,
        ps.q_starts_t,
        ps.seq_lens_t,
        work,
        out,
        acc,
        ml,
        sink if sink is not None else qc,
        float(scale) * _LOG2E,
        float(softcap),
        int(window),
        ps.page_table.shape[1],
        nsplit,
        kpool.stride(0),
        kpool.stride(1),
        vpool.stride(0),
        vpool.stride(1),
        N=n,
        G=g,
        D=d,
        DP=dp,
        PAGE=ps.page_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DIRECT=direct,
        SOFTCAP=softcap > 0,
        SINK=sink is not None,
        IEEE=q.dtype == torch.float32 or not q.is_cuda,
        ONE=one,
        num_warps=warps,
        num_stages=stages,
        **launch_options(q),
    )
    if not direct:
        nsp = max(2, 1 << (nsplit - 1).bit_length())  # the splits a combine program loads at once
        tp.paged_combine_kernel[(w, hkv, block_m)](
            acc,
            ml,
            ps.q_starts_t,
            work,
            out,
            nsplit,
            hkv,
            N=n,
            G=g,
            D=d,
            DP=dp,
            BLOCK_M=block_m,
            NSP=nsp,
            ONE=one,
            num_warps=1,
            **launch_options(out),
        )
    return out


def attention_ref(
    ps: PagedStep,
    layer: int,
    q: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
    window: int = -1,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch reference (the CPU path): a decode step (one query per sequence) in one batched product
    over the page table; otherwise sequence by sequence. float32 inside. With a window only the pages of
    the keys some query sees are read (`first_page`)."""
    if len(ps.seq_lens) > 1 and ps.q_starts[-1] == len(ps.seq_lens):
        return _decode_batched(ps, layer, q, scale, softcap, window, sink)
    out = torch.empty_like(q)
    P = ps.page_size
    for b, total in enumerate(ps.seq_lens):
        qs, qe = ps.q_starts[b], ps.q_starts[b + 1]
        p0 = first_page(total - (qe - qs), window, P)
        kk, vv = _sequence_kv(ps, layer, b, p0, total)
        if window > 0:  # from the first query's window start
            lo = max(0, total - (qe - qs) - window + 1) - p0 * P
            kk, vv = kk[lo:], vv[lo:]
        out[qs:qe] = _attend_one(q[qs:qe], kk, vv, total, scale, softcap, window, sink)
    return out


def _sequence_kv(ps: PagedStep, layer: int, b: int, p0: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of sequence `b`'s positions `[p0 * P, total)` as `[L, kv_heads, head_dim]`: a view of
    the pool where its pages from `p0` on are consecutive (no copy), else gathered page by page."""
    P = ps.page_size
    pages = ps.pages_of(b)[p0 : -(-total // P)]
    keys, values = ps.storage.keys(layer), ps.storage.values(layer)  # [pages, P, Hkv, D]
    n = total - p0 * P
    first = pages[0]
    if pages[-1] - first == len(pages) - 1 and all(x == first + i for i, x in enumerate(pages)):
        return keys[first : first + len(pages)].flatten(0, 1)[:n], values[first : first + len(pages)].flatten(
            0, 1
        )[:n]
    idx = torch.tensor(pages, dtype=torch.int64, device=keys.device)
    return keys.index_select(0, idx).flatten(0, 1)[:n], values.index_select(0, idx).flatten(0, 1)[:n]


def first_page(pos: int, window: int, page_size: int) -> int:
    """The first page a query at position `pos` (and every later one) reads: 0, or with a window the page of
    key `pos - window + 1`. Pages before it are never read again by that sequence's layers of that window."""
    return max(0, pos - window + 1) // page_size if window > 0 else 0


def _decode_batched(
    ps: PagedStep,
    layer: int,
    q: torch.Tensor,
    scale: float,
    softcap: float,
    window: int,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """`q` `[B, N, D]`, one query per sequence at position `seq_lens[b] - 1`: every sequence's pages read at
    once (padded to the longest, the padding masked), grouped-query heads without repeating K/V. With a
    window, from the first page any sequence's window reaches (pages before a sequence's own window, which
    may be gone, read as page 0 and masked)."""
    b, n, d = q.shape
    P = ps.page_size
    lens = ps.seq_lens_t.long()
    maxp = -(-max(ps.seq_lens) // P)
    p0 = min(first_page(x - 1, window, P) for x in ps.seq_lens)
    pages = ps.page_table[:, p0:maxp].long().clamp(min=0)  # [B, maxp - p0]
    keys, values = ps.storage.keys(layer), ps.storage.values(layer)  # [pages, P, Hkv, D]
    hkv = keys.shape[2]
    k = keys[pages].flatten(1, 2).float().permute(0, 2, 3, 1)  # [B, Hkv, D, L]
    v = values[pages].flatten(1, 2).float().transpose(1, 2)  # [B, Hkv, L, D]
    s = torch.matmul(q.float().view(b, hkv, n // hkv, d), k) * scale  # [B, Hkv, G, L]
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    kpos = p0 * P + torch.arange(k.shape[-1], device=q.device)
    drop = kpos.unsqueeze(0) >= lens.unsqueeze(1)  # [B, L]: past each sequence's end
    if window > 0:
        drop = drop | (kpos.unsqueeze(0) <= (lens - 1 - window).unsqueeze(1))
    s = s.masked_fill(drop[:, None, None, :], float("-inf"))
    v = v.masked_fill(drop[:, None, :, None], 0.0)  # slots never written may hold NaN: 0 * NaN is NaN
    p = softmax_with_sink(s, sink.view(hkv, n // hkv, 1) if sink is not None else None)
    o = torch.matmul(p, v)  # [B, Hkv, G, D]
    return o.reshape(b, n, d).to(q.dtype)


def _attend_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    total: int,
    scale: float,
    softcap: float,
    window: int,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """`q` `[m, N, D]` at positions `total - m .. total - 1`; `k`/`v` `[L, Hkv, D]` (views of the pool are
    fine): positions `total - L .. total - 1` (all of them, or from the first query's window start). float32
    inside; the keys and values are read in place by every query head of their group (no copy per head):
    torch's fused attention (grouped heads), or with soft-capping, sinks or one query on the CPU the query
    heads of a KV head as one product's rows."""
    m, n, d = q.shape
    length, hkv = k.shape[0], k.shape[1]
    g = n // hkv
    keep = None
    if m > 1 or window > 0:
        qpos = torch.arange(total - m, total, device=q.device).unsqueeze(1)
        kpos = torch.arange(total - length, total, device=q.device).unsqueeze(0)
        keep = kpos <= qpos
        if window > 0:
            keep = keep & (kpos > qpos - window)
    kf, vf = k.float().permute(1, 0, 2), v.float().permute(1, 0, 2)  # [Hkv, L, D]
    # one query on the CPU: the grouped products below (torch's fused CPU kernel costs several times more)
    if softcap <= 0 and sink is None and (m > 1 or q.is_cuda):
        o = F.scaled_dot_product_attention(
            q.float().transpose(0, 1).unsqueeze(0), kf[None], vf[None], keep, scale=scale, enable_gqa=True
        )  # [1, N, m, D]
        return o[0].transpose(0, 1).to(q.dtype)
    qg = q.float().view(m, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * m, d)  # rows (head, token)
    s = torch.bmm(qg, kf.transpose(1, 2)) * scale  # [Hkv, G * m, L]
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.view(hkv, g, m, length)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))  # [m, L] broadcast over (head, group)
    p = softmax_with_sink(s, sink.view(hkv, g, 1, 1) if sink is not None else None)
    o = torch.bmm(p.view(hkv, g * m, length), vf)  # [Hkv, G * m, D]
    return o.view(hkv, g, m, d).permute(2, 0, 1, 3).reshape(m, n, d).to(q.dtype)
