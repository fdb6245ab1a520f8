"""The batched native runner: the lowered program over a flattened ragged batch and a paged KV pool.

    runner = NativeRunner(spec, "cuda")             # the pool is allocated once, here
    logits = runner.run(BatchStep(...))              # [R, vocab] float32: one row per chunk that asks

A step's tokens run as one sequence of T positions (`[1, T]` through every per-token op: embeddings,
norms, projections, MLPs); the attention ops see the step's `PagedStep` (`RunCtx.paged`) and attend each
token over its own sequence's pages only; the lm_head sees only the rows whose logits are wanted. The
program is shared with the batch-1 `NativeDecoder`s of the package (one copy of the weights).

On CUDA, a step of decodes only (one token per sequence) replays a CUDA graph captured for its batch size
padded up to a bucket (`GRAPH_BATCHES`), and a step that is one sequence's prefill chunk of up to 1024
tokens replays one captured for its length padded up to the next size in `PREFILL_GRAPH_TOKENS` (the
chunk is padded with copies of its last token at the following positions). Every per-step input lives in
device buffers (token ids, positions, slots, KV lengths, page tables, each sequence's first row, logits
rows: one upload from pinned memory, no synchronisation). A step that verifies one sequence's draft tokens
(speculative decoding: logits for every fed position) replays a graph of `VERIFY_GRAPH_TOKENS` positions
with a logits row per position, captured the first time one is needed; a failed capture of one turns
only verify graphs off. Padding writes its keys into a scratch page outside the pool; padding sequences
of a decode step attend to it alone, the padding rows of a prefill chunk are past its sequence's last row
(the attention kernels skip them: their values are garbage that no real row reads), and their logits are
dropped. Mixed steps run eagerly. A capture that fails turns
graphs off for the runner (logged once) and leaves the process usable.

A package can be batched when every KV-bound node is a fused attention op (GroupQueryAttention, or ai.onnx
Attention without a mask) and the graph needs no attention mask or extra inputs: `batchable(program,
spec)`. Other packages run one request per `NativeDecoder` (the engine decides).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from onnxgen.backends.batch import BatchStep, DeviceTokens, SeqChunk
from onnxgen.backends.native import kernels, paged
from onnxgen.backends.native.device import (
    device_lock,
    input_dtype,
    kv_dtype,
    shared_program,
    torch_device,
)
from onnxgen.backends.native.kernels import copy_page_prefix, greedy_advance, repair_after_failed_capture
from onnxgen.backends.native.lowering import Program
from onnxgen.backends.native.ops import RunCtx
from onnxgen.errors import BackendUnavailable, DeviceOutOfMemory, NotCapturable
from onnxgen.kv.storage import PageStorage, page_bytes

log = logging.getLogger(__name__)

PAGE_SIZE = 16
CPU_KV_BYTES = 2 << 30  # default pool on the CPU: 2 GiB of address space (pages are touched when written)
GPU_KV_FRACTION = 0.8  # default pool on CUDA: this fraction of the device memory free after the weights
GRAPH_BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # decode steps: sequences, padded up
# one sequence's prefill chunk: tokens, padded up (a turn of 65 tokens replays the 80-token step, not 128)
PREFILL_GRAPH_TOKENS = (16, 32, 48, 64, 80, 96, 128, 192, 256, 384, 512, 768, 1024)
VERIFY_GRAPH_TOKENS = (4, 8, 16)  # one sequence's last sample + drafts, a logits row per position
RUN_TOKENS = 32  # a decode graph records the chosen tokens of this many consecutive replays
RUN_GRAPH_STEPS = int(os.environ.get("ONNXGEN_RUN_GRAPH_STEPS", "4"))
"""Decode graphs of up to `RUN_GRAPH_BATCH` sequences are also captured `RUN_GRAPH_STEPS` decode steps deep
(`_Graph.multi`, the step's body that many times over in one graph), which greedy runs replay where they
can (`_graph_decodes`): no graph boundary between those steps — each replay's last kernel ends the chain of
programmatic dependent launches, and the next replay starts only once it has finished. 1 turns it off
(`ONNXGEN_RUN_GRAPH_STEPS`); read at load; above `RUN_TOKENS` it would never fit a run. Measured on an H100
(docs/benchmarks/decode-gpu.md, eleventh session): 0.2-0.8 % off the 0.5B / 1B decode step."""
# a run's first replay (the one after the upload) is the several-step graph too where it fits (a greedy run of 8
# steps: two replays instead of five); False: one step, as before (`benchmarks/gpu_gaps.py` times both)
RUN_FIRST_MULTI = True
# a run's tokens are copied to the host every this many steps (and at its end), each part behind an event of
# its own (`DecodeRun.parts`), so the host can take a run's first steps while the device computes the rest:
# a reply that ends by EOS in a run's first part returns without waiting for the others. 0: one part a run
PART_STEPS = 4
RUN_GRAPH_BATCH = 8  # decode graphs of more sequences: one step deep only (a step is long enough there)
# a batch size whose attention runs unpipelined up to at least this many keys (`paged.short_keys`) gets a
# second decode graph, replayed while its sequences stay that short
SHORT_GRAPH_KEYS = 1024


# verify steps computed rowwise (the default); ONNXGEN_ROWWISE=0 lets benchmarks time what exactness costs
ROWWISE = os.environ.get("ONNXGEN_ROWWISE", "1") != "0"


def _rowwise(step: BatchStep) -> bool:
    """Whether `step` verifies drafts and so computes every token exactly as a one-token step would
    (`RunCtx.rowwise`): each chunk wants the logits of all its tokens, some chunk has several, and the rows
    are few enough for rowwise products (`kernels.ROWWISE_ROWS`). Such rows are the same bits as plain
    decoding's on a Triton device, so speculative decoding returns plain greedy decoding's tokens there."""
    n = step.num_tokens
    return (
        ROWWISE
        and len(step.seqs) < n <= kernels.ROWWISE_ROWS
        and all(s.logits == len(s.tokens) for s in step.seqs)
    )


def batchable(program: Program, spec: Any) -> str | None:
    """None when the package can run ragged batches over a paged pool, else the reason it cannot."""
    if not program.static_ok:
        return "its attention is not one fused op per layer (KV concatenated in the graph)"
    if program.uses_attention_mask:
        return "the graph reads its attention mask beyond the KV lengths"
    if spec.extra_inputs:
        return f"the graph takes extra inputs ({', '.join(i.name for i in spec.extra_inputs)})"
    return None


def replay_plan(
    k: int, greedy: bool, multi: bool
) -> list[tuple[int, int, int | None, tuple[int, int, bool] | None]]:
    """How `_graph_decodes` runs `k` decode steps: one (j, n, flush, part) per replay — its first step `j` and
    its steps `n` (more than one: the `RUN_GRAPH_STEPS`-step graph, for `greedy` runs of a graph that has it
    (`multi`) where its steps fit before the run's end and within one token record); greedy runs: `flush`,
    the first step whose recorded tokens this replay copies into the run's tokens (at the end of each record
    window of `RUN_TOKENS` steps and of the run), else None; `part`: the rows (a, e) staged to the host after
    this replay, with whether they are read from the run's tokens (else from the graph's record, all in its
    current window), or None. Parts end past each `PART_STEPS` boundary, at each flush and at the run's end,
    and cover the run's rows in order."""
    plan = []
    j = staged = 0
    while j < k:
        deep = (
            greedy
            and multi
            and j + RUN_GRAPH_STEPS <= k
            and j % RUN_TOKENS + RUN_GRAPH_STEPS <= RUN_TOKENS
            and (j > 0 or RUN_FIRST_MULTI)
        )
        n = RUN_GRAPH_STEPS if deep else 1
        last = j + n - 1
        flush = (
            last - last % RUN_TOKENS if greedy and ((last + 1) % RUN_TOKENS == 0 or last == k - 1) else None
        )
        flushed = not greedy or flush is not None
        part = None
        if last == k - 1 or flush is not None or (PART_STEPS and (last + 1) // PART_STEPS > j // PART_STEPS):
            part, staged = (staged, last + 1, flushed), last + 1
        plan.append((j, n, flush, part))
        j += n
    return plan


@dataclass
class _Graph:
    """A captured step of `batch` sequences of `tokens` positions each (decode: 1; a prefill chunk of one
    sequence: its padded length) returning `rows` logits rows (decode: one per sequence; prefill: 1; a
    verify step: one per position), and the device buffers it reads and writes, with pinned host mirrors."""

    batch: int
    tokens: int
    rows: int
    wide: torch.Tensor  # int64 [3 * T + rows + 2]: token ids, positions, slots (T = batch * tokens), logits
    #                      rows, then (decode graphs) replays since the run began and live rows
    narrow: torch.Tensor  # int32 [batch * (2 + max pages) + 1]: KV lengths, page table rows, first rows
    host_wide: torch.Tensor  # pinned host mirrors of `wide` and `narrow`, filled each step
    host_narrow: torch.Tensor
    uploaded: Any  # a CUDA event recorded after the last upload from the host mirrors
    graph: Any = None
    out: Any = None  # the program's logits output [1, batch, vocab]
    step: Any = None  # the step's attention metadata (NOTE: the graph reads its tensors: keep them alive)
    toks: Any = (
        None  # decode graphs: [RUN_TOKENS, batch] int64, each replay's greedy tokens (`decode_advance`)
    )
    # the KV length its attention's pipeline depth is chosen for (0: the context; `paged.SHORT_BLOCKS`); the
    # key splits are the context's either way, so the graph is right for any length
    keys: int = 0
    multi: Any = None  # decode graphs: the same step `RUN_GRAPH_STEPS` times over in one graph (or None)


@dataclass
class DecodeRun(DeviceTokens):
    """A launched run of decode steps (`NativeRunner.launch_decodes`): its `[k, B]` tokens on the device and,
    on CUDA, their pinned host copy, filled part by part: `parts` holds (rows, event) in order — the first
    `rows` rows are on the host once `event` has completed."""

    host: torch.Tensor | None = None
    parts: list[tuple[int, Any]] = field(default_factory=list)


class NativeRunner:
    """`BatchRunner` over a lowered ONNX graph (backend "native")."""

    backend = "native"

    def __init__(
        self,
        spec: Any,
        device: str = "cpu",
        *,
        page_size: int = PAGE_SIZE,
        kv_bytes: int | None = None,
        cuda_graphs: bool = True,
        max_batch: int = 64,
        int4: str | None = None,
    ) -> None:
        """`kv_bytes`: the pool's size in bytes (default: `CPU_KV_BYTES` on the CPU, `GPU_KV_FRACTION` of the
        free device memory on CUDA). `cuda_graphs`: replay decode steps of up to `max_batch` sequences from
        CUDA graphs (captured at load). `int4`: MatMulNBits weights "dense" (dequantized at load) or "packed"
        (kept packed, `ops.quant`'s Int4Linear); None: `device.int4_mode`'s default (dense). Raises
        `BackendUnavailable` when the package cannot be batched, `DeviceOutOfMemory` when the pool cannot be
        allocated."""
        t0 = time.perf_counter()
        self.spec = spec
        self.device = device
        self._dev = torch_device(device)
        dtype = kv_dtype(spec)
        self.program = shared_program(spec, self._dev, int4)
        why = batchable(self.program, spec)
        if why is not None:
            raise BackendUnavailable(f"{spec.path}: cannot batch this package: {why}")
        per_page = page_bytes(spec.num_layers, page_size, spec.num_kv_heads, spec.head_size, dtype.itemsize)
        if kv_bytes is None:
            if self._dev.type == "cuda":  # pragma: cuda
                free, _total = torch.cuda.mem_get_info(self._dev)
                kv_bytes = int(free * GPU_KV_FRACTION)
            else:
                kv_bytes = CPU_KV_BYTES
        num_pages = max(int(kv_bytes) // per_page, 1)
        if num_pages * page_size < spec.context_length:
            log.warning(
                "the KV pool holds %d tokens, less than one full context (%d)",
                num_pages * page_size,
                spec.context_length,
            )
        try:  # one page more than the pool: the scratch page padding rows of graph steps write into
            self.storage = PageStorage(
                spec.num_layers,
                num_pages + 1,
                page_size,
                spec.num_kv_heads,
                spec.head_size,
                dtype,
                self._dev,
                copy_page_prefix,
            )
        except torch.cuda.OutOfMemoryError as exc:  # pragma: cuda
            raise DeviceOutOfMemory(f"cannot allocate a KV pool of {kv_bytes / 2**30:.1f} GiB") from exc
        self.page_size = page_size
        self.num_pages = num_pages
        self._scratch = num_pages
        self._rows = paged.PoolRows(self.storage)
        self.device_lock = device_lock(self._dev)
        p = self.program
        self._in_ids = p.input_slots.get(spec.input_ids_name, -1)
        self._in_pos = p.input_slots.get(spec.position_ids_name or "", -1)
        self._ids_dtype = input_dtype(spec, spec.input_ids_name, torch.int64)
        self._pos_dtype = input_dtype(spec, spec.position_ids_name, torch.int64)
        self._max_pages = -(-spec.context_length // page_size)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._short: dict[int, _Graph] = {}  # decode graphs by batch for KV lengths up to their `keys`
        self._verify: dict[
            int, _Graph | None
        ] = {}  # verify steps by padded length (None: its capture failed)
        self._pool: Any = None
        on = cuda_graphs and self._dev.type == "cuda"
        self._graph_batches = [b for b in GRAPH_BATCHES if b <= max_batch] if on else []
        if on and max_batch > GRAPH_BATCHES[-1]:
            self._graph_batches.append(max_batch)
        self._graph_chunks = [m for m in PREFILL_GRAPH_TOKENS if m <= spec.context_length] if on else []
        self.steps = {"graph": 0, "eager": 0, "multi": 0}  # "multi": replays of `RUN_GRAPH_STEPS`-step graphs
        with self.device_lock:
            for key in [*((b, 1) for b in self._graph_batches), *((1, m) for m in self._graph_chunks)]:
                if not self.cuda_graphs:  # a capture failed: graphs are off
                    break
                self._capture(*key)
            group = spec.num_heads // spec.num_kv_heads
            for b in self._graph_batches:  # decode graphs for short contexts: unpipelined attention
                keys = paged.short_keys(
                    b * spec.num_kv_heads, group, spec.head_size, spec.context_length, self._dev
                )
                if not self.cuda_graphs or keys < SHORT_GRAPH_KEYS or keys >= spec.context_length:
                    continue
                self._capture(b, 1, keys=keys)
        self.load_seconds = time.perf_counter() - t0

    @property
    def cuda_graphs(self) -> bool:
        """Whether steps replay CUDA graphs (False after a failed capture, and on the CPU)."""
        return bool(self._graph_batches)

    @property
    def verify_sizes(self) -> tuple[int, ...]:
        """`BatchRunner.verify_sizes`: with CUDA graphs a verify step replays the graph of the next
        `VERIFY_GRAPH_TOKENS` size (its padding rows computed too)."""
        return VERIFY_GRAPH_TOKENS if self._graph_batches else ()

    def _graph_for(self, step: BatchStep) -> _Graph | None:
        """The captured graph that runs `step`: decodes only (batch padded up to a bucket), one sequence's
        prefill chunk (padded up to a captured size, whose padding positions stay inside the context), or
        one sequence's draft verification (`_verify_graph`)."""
        if not self._graph_batches:
            return None
        seqs = step.seqs
        if any(s.logits > 1 for s in seqs):  # draft verification: one sequence's rows from a verify graph
            return self._verify_graph(step)
        if all(len(s.tokens) == 1 for s in seqs):
            return self._decode_graph(step, 1)
        if len(seqs) == 1:
            n = len(seqs[0].tokens)
            m = next((x for x in self._graph_chunks if x >= n), 0)
            if m and seqs[0].start + m <= self.spec.context_length:
                return self._graphs.get((1, m))
        return None

    def _decode_graph(self, step: BatchStep, k: int) -> _Graph | None:
        """The decode graph for `k` decode steps of `step`'s sequences: its batch padded up to a captured one,
        the short-context graph while every sequence's KV stays within its `keys` (it would compute longer
        ones right too, only slower: its attention unpipelined over longer splits)."""
        bucket = next((b for b in self._graph_batches if b >= len(step.seqs)), 0)
        short = self._short.get(bucket)
        if short is not None and max(s.start for s in step.seqs) + k <= short.keys:
            return short
        return self._graphs.get((bucket, 1))

    def _verify_graph(self, step: BatchStep) -> _Graph | None:  # pragma: cuda
        """The verify graph for a step of one sequence whose every fed position wants logits, captured the
        first time its size is needed (a failure turns that size off, and nothing else); else None."""
        (s, *more) = step.seqs
        n = len(s.tokens)
        m = next((x for x in VERIFY_GRAPH_TOKENS if x >= n), 0)
        if more or s.logits != n or not m or s.start + m > self.spec.context_length:
            return None
        if m not in self._verify:
            self._verify[m] = self._capture(1, m, rows=m, disable_on_failure=False)
        return self._verify[m]

    def kv_bytes(self) -> int:
        return self.storage.nbytes()

    def run(self, step: BatchStep) -> torch.Tensor:
        """Logits `[R, vocab]` (float32, on the device): each chunk's last `logits` tokens', in order."""
        try:
            with self.device_lock:
                g = self._graph_for(step)
                return self._run_graph(g, step) if g is not None else self._run_eager(step)
        except torch.cuda.OutOfMemoryError as exc:  # pragma: cuda
            raise DeviceOutOfMemory(
                f"the device ran out of memory running a batch of {step.num_tokens} token(s)"
            ) from exc

    def launch_decodes(
        self, step: BatchStep, k: int, choose: Any, offset: int = 0, after: DeviceTokens | None = None
    ) -> DecodeRun:
        """`BatchRunner.launch_decodes`: on CUDA with graphs, `_graph_decodes`, and the tokens copied to pinned
        memory behind an event (nothing waits here); elsewhere `k` eager steps, each fed the previous step's
        choice on the device."""
        b = len(step.seqs)
        first = after.toks[-1] if after is not None else None  # the previous run's last tokens: our first ids
        try:
            with self.device_lock:
                g = self._decode_graph(step, k)
                if g is not None:  # pragma: cuda
                    return self._graph_decodes(g, step, k, choose, first, offset)
                toks = torch.empty((k, b), dtype=torch.int64, device=self._dev)
                for j in range(k):
                    seqs = tuple(
                        SeqChunk(s.tokens if j == 0 else [0], s.start + j, s.pages, 1) for s in step.seqs
                    )
                    logits = self._run_eager(BatchStep(seqs), toks[j - 1] if j else first)
                    toks[j] = choose(logits, offset + j)
                return DecodeRun(toks)
        except torch.cuda.OutOfMemoryError as exc:  # pragma: cuda
            raise DeviceOutOfMemory(
                f"the device ran out of memory running {k} decode steps of {b} sequence(s)"
            ) from exc

    def stage_tokens(self, toks: torch.Tensor) -> DecodeRun:
        """`BatchRunner.stage_tokens`: on CUDA their copy to pinned memory and an event after it (one part)."""
        if not toks.is_cuda:
            return DecodeRun(toks)
        # pragma: cuda-begin
        run = DecodeRun(toks, torch.empty(toks.shape, dtype=toks.dtype, pin_memory=True))
        self._stage_part(run, toks, 0, len(toks))
        return run
        # pragma: cuda-end

    @staticmethod
    def _stage_part(run: DecodeRun, src: torch.Tensor, a: int, b: int) -> None:  # pragma: cuda
        """Enqueue the copy of the run's rows `a:b` (`src`, on the device) to its host buffer and an event."""
        run.host[a:b].copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        run.parts.append((b, done))

    def decode_parts(self, run: DecodeRun) -> tuple[int, ...]:
        """`BatchRunner.decode_parts`: on CUDA the run's staged parts; elsewhere (the run is computed already)
        parts as a run of greedy four-step replays would have them, so the host reads alike everywhere."""
        if run.parts:  # pragma: cuda
            return tuple(rows for rows, _ in run.parts)
        k = len(run.toks)
        return (*range(PART_STEPS, k, PART_STEPS), k) if PART_STEPS else (k,)

    def collect_decodes(self, run: DecodeRun, rows: int | None = None) -> list[list[int]]:
        """`BatchRunner.collect_decodes`."""
        rows = len(run.toks) if rows is None else rows
        if run.parts:  # pragma: cuda
            next(done for end, done in run.parts if end >= rows).synchronize()
            return run.host[:rows].tolist()
        return run.toks[:rows].tolist()

    def _graph_decodes(
        self, g: _Graph, step: BatchStep, k: int, choose: Any, first: torch.Tensor | None, offset: int
    ) -> DecodeRun:  # pragma: cuda
        """`k` decode steps as `k` replays of the decode graph: the first uploads the inputs (page tables for
        the whole run; `first`: its token ids on the device); each replay then chooses its greedy tokens and
        advances the inputs to the next step on the device (`_graph_body`), so the host only enqueues
        replays. Greedy rows take the tokens the graph recorded (copied out every `RUN_TOKENS` steps), and
        replay the `RUN_GRAPH_STEPS`-step graph (`_Graph.multi`) wherever its steps fit before the run's end
        and within one token record, the first replay included (a run of 8 is two replays); otherwise `choose`
        picks each step's tokens from the logits rows, which replace the greedy ids before the next replay.
        The tokens go to the host every `PART_STEPS` steps and at the run's end (`DecodeRun.parts`)."""
        b = len(step.seqs)
        toks = torch.empty((k, b), dtype=torch.int64, device=self._dev)
        run = DecodeRun(toks, torch.empty((k, b), dtype=torch.int64, pin_memory=True))
        greedy = bool(getattr(choose, "greedy", False))
        rows = g.out.reshape(g.batch, -1)[:b]
        for j, n, flush, part in replay_plan(k, greedy, g.multi is not None):
            if j == 0:
                self._run_graph(g, step, first, raw=True, run=k, multi=n > 1)
            else:
                self._replay(g, n > 1)
            last = j + n - 1
            if not greedy:
                toks[j] = choose(rows, offset + j)
                if j < k - 1:
                    g.wide[:b].copy_(toks[j])
            elif flush is not None:
                toks[flush : last + 1] = g.toks[: last + 1 - flush, :b]
            if part is not None:
                a, e, flushed = part
                self._stage_part(
                    run, toks[a:e] if flushed else g.toks[a % RUN_TOKENS : (e - 1) % RUN_TOKENS + 1, :b], a, e
                )
        return run

    # --- eager -------------------------------------------------------------------------------------

    def _run_eager(self, step: BatchStep, ids_t: torch.Tensor | None = None) -> torch.Tensor:
        """`ids_t`: the step's token ids as a device tensor (they replace the chunks' `tokens`)."""
        t = step.num_tokens
        ps = paged.build_step(step, self.storage, self.page_size, self._dev)
        rowwise = _rowwise(step)
        if rowwise or t == len(
            step.seqs
        ):  # verify rows or decodes: key splits planned as a captured decode's
            ps.plan_len, ps.per_token = self.spec.context_length, rowwise
        env = self.program.new_env()
        if ids_t is None:
            ids_t = torch.tensor([tok for s in step.seqs for tok in s.tokens], dtype=torch.int64)
        env[self._in_ids] = ids_t.to(self._dev, non_blocking=True).view(1, t).to(self._ids_dtype)
        if self._in_pos >= 0:
            env[self._in_pos] = ps.positions.view(1, t).to(self._pos_dtype)
        out = self.program.execute(
            env, RunCtx(self._rows, -1, t, ps.positions, last=ps.last, paged=ps, rowwise=rowwise)
        )
        self.steps["eager"] += 1
        return out.reshape(-1, out.shape[-1]).float()

    # --- CUDA graphs for decode steps --------------------------------------------------------------

    def _run_graph(
        self,
        g: _Graph,
        step: BatchStep,
        ids_t: torch.Tensor | None = None,
        raw: bool = False,
        run: int = 0,
        multi: bool = False,
    ) -> torch.Tensor:  # pragma: cuda
        """`ids_t`: a decode step's token ids as a device tensor `[B]` (copied in after the upload). `raw`: the
        logits as the graph's output rows in the model's dtype (a view, valid until the next replay; the
        device choice reads them exactly), not a float32 copy. `run`: the first of `run` decode steps whose
        later replays advance their inputs on the device (`_graph_decodes`): the page tables are uploaded for
        the run's last step and the sequences are marked live. `multi`: replay the run's first
        `RUN_GRAPH_STEPS` steps (`_Graph.multi`; the rows returned are then the last step's)."""
        b, m, P = len(step.seqs), g.tokens, self.page_size
        t = g.batch * m
        g.uploaded.synchronize()  # NOTE: the host mirrors are rewritten only after their last upload
        wide, nar = g.host_wide.numpy(), g.host_narrow.numpy()
        ids, pos, slots, last = wide[:t], wide[t : 2 * t], wide[2 * t : 3 * t], wide[3 * t : 3 * t + g.rows]
        mp = self._max_pages
        lens, table = nar[: g.batch], nar[g.batch : g.batch * (1 + mp)].reshape(g.batch, mp)
        qs = nar[g.batch * (1 + mp) :]  # each sequence's first row (and the end of the last)
        scratch = self._scratch
        if m == 1:  # decodes: one token per sequence
            starts = [s.start for s in step.seqs]
            ids[:b] = [s.tokens[0] for s in step.seqs]
            pos[:b] = starts
            slots[:b] = [s.pages[p // P] * P + p % P for s, p in zip(step.seqs, starts, strict=True)]
            last[:] = np.arange(g.batch)
            qs[:] = np.arange(g.batch + 1)
            lens[:b] = np.asarray(starts) + 1
            for i, s in enumerate(step.seqs):  # entries past the run's last position are never read
                table[i, : (starts[i] + max(run, 1) - 1) // P + 1] = s.pages[
                    : (starts[i] + max(run, 1) - 1) // P + 1
                ]
            # padding rows: one position on the scratch page, attending to it alone
            ids[b:], pos[b:], slots[b:], lens[b:], table[b:, 0] = 0, 0, scratch * P, 1, scratch
        else:  # one sequence's prefill chunk, padded with copies of its last token at the next positions
            (s,) = step.seqs
            n, p0 = len(s.tokens), s.start
            where = np.arange(p0, p0 + m)
            ids[:n], ids[n:] = s.tokens, s.tokens[-1]
            pos[:] = where
            need = (p0 + n - 1) // P + 1
            slots[:n] = np.asarray(s.pages[:need])[where[:n] // P] * P + where[:n] % P
            slots[n:] = scratch * P + where[n:] % P  # the padding's keys go to the scratch page
            lens[0] = p0 + n
            if g.rows == 1:
                last[0] = n - 1
            else:  # a verify step: every real position's row (the padding's rows repeat the last)
                last[:] = np.minimum(np.arange(g.rows), n - 1)
            qs[0], qs[1] = 0, n  # the attention kernels take the n real rows only
            table[0, :need] = s.pages[:need]  # entries past the KV length are never read
        wide[-2:] = 0, (b if run else 0)  # replays since the run began; live rows (`decode_advance`)
        g.wide.copy_(g.host_wide, non_blocking=True)
        g.narrow.copy_(g.host_narrow, non_blocking=True)
        g.uploaded.record()
        if ids_t is not None:
            g.wide[:b].copy_(ids_t)
        assert not multi or run >= RUN_GRAPH_STEPS
        self._replay(g, multi)
        if g.rows > 1 and m > 1:  # a verify step: every real position's row
            return g.out.reshape(g.rows, -1)[: len(step.seqs[0].tokens)].float()
        rows = g.out.reshape(g.batch, -1)[:b]
        return rows if raw else rows.float()

    def _replay(self, g: _Graph, multi: bool = False) -> None:  # pragma: cuda
        """Replay `g`'s step, or with `multi` its `RUN_GRAPH_STEPS`-step graph, and count the steps."""
        if multi:
            assert g.multi is not None
            g.multi.replay()
            self.steps["multi"] += 1
        else:
            g.graph.replay()
        self.steps["graph"] += RUN_GRAPH_STEPS if multi else 1

    def _graph_step(self, g: _Graph) -> paged.PagedStep:  # pragma: cuda
        """The attention metadata of a graph's step: views of its device buffers, and host shapes sized for
        any KV length up to the graph's `keys` (by default the context), the key splits planned for the whole
        context either way (so a sequence splits alike in every step); a verify step's tokens are attended
        one by one, as decode steps (`_rowwise`)."""
        bm, m, t, mp = g.batch, g.tokens, g.batch * g.tokens, self._max_pages
        return paged.PagedStep(
            self.storage,
            self.page_size,
            positions=g.wide[t : 2 * t],
            slots=g.wide[2 * t : 3 * t],
            last=g.wide[3 * t : 3 * t + g.rows],
            page_table=g.narrow[bm : bm * (1 + mp)].view(bm, mp),
            q_starts_t=g.narrow[bm * (1 + mp) :],
            seq_lens_t=g.narrow[:bm],
            q_starts=list(range(0, t + 1, m)),
            seq_lens=[g.keys or self.spec.context_length] * bm,
            plan_len=self.spec.context_length,
            per_token=ROWWISE and g.rows > bm,
        )

    def _graph_forward(self, g: _Graph, ps: paged.PagedStep) -> torch.Tensor:  # pragma: cuda
        t = g.batch * g.tokens
        env = self.program.new_env()
        env[self._in_ids] = g.wide[:t].view(1, t).to(self._ids_dtype)
        if self._in_pos >= 0:
            env[self._in_pos] = ps.positions.view(1, t).to(self._pos_dtype)
        return self.program.execute(
            env,
            RunCtx(
                self._rows, -1, t, ps.positions, last=ps.last, paged=ps, static=True, rowwise=ps.per_token
            ),
        )

    def _graph_body(self, g: _Graph, ps: paged.PagedStep) -> torch.Tensor:  # pragma: cuda
        """What a graph runs: the forward step; a decode step then chooses each row's greedy token and
        advances its own inputs to the next decode step (`kernels.greedy_advance`; with no live rows, the
        host fills every input before each replay, only a counter moves)."""
        out = self._graph_forward(g, ps)
        if g.toks is not None:
            greedy_advance(
                out.reshape(g.batch, -1), g.wide, g.narrow, g.toks, g.batch, self._max_pages, self.page_size
            )
        return out

    def _capture(
        self, batch: int, tokens: int, rows: int | None = None, disable_on_failure: bool = True, keys: int = 0
    ) -> _Graph | None:  # pragma: cuda
        """Capture the step of `batch` sequences of `tokens` positions returning `rows` logits rows (default:
        one per sequence; all padding: harmless to run); `keys`: a decode graph for KV lengths up to that
        (`_short`: kept apart from the graph for any length). On failure repair what a broken capture leaves
        behind and, with `disable_on_failure`, turn graphs off for this runner; return None. Without it (verify
        graphs) the graph gets a memory pool of its own, so a failure leaves the other graphs' pool alone."""
        t, mp, P = batch * tokens, self._max_pages, self.page_size
        rows = batch if rows is None else rows
        host_wide = torch.zeros(3 * t + rows + 2, dtype=torch.int64).pin_memory()
        host_narrow = torch.full((batch * (2 + mp) + 1,), self._scratch, dtype=torch.int32).pin_memory()
        host_narrow[batch * (1 + mp) :] = torch.arange(0, t + 1, tokens, dtype=torch.int32)  # first rows
        w = host_wide.numpy()
        w[t : 2 * t] = np.tile(np.arange(tokens), batch)
        w[2 * t : 3 * t] = self._scratch * P + w[t : 2 * t] % P
        w[3 * t : 3 * t + rows] = np.arange(batch) * tokens + tokens - 1 if rows == batch else np.arange(rows)
        host_narrow.numpy()[:batch] = tokens
        g = _Graph(
            batch,
            tokens,
            rows,
            host_wide.to(self._dev),
            host_narrow.to(self._dev),
            host_wide,
            host_narrow,
            torch.cuda.Event(),
            keys=keys,
        )
        g.uploaded.record()
        if (
            tokens == 1 and rows == batch
        ):  # a decode step: its replays can follow each other (`launch_decodes`)
            g.toks = torch.zeros((RUN_TOKENS, batch), dtype=torch.int64, device=self._dev)
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            ps = self._graph_step(g)
            with torch.cuda.stream(stream):  # compile and settle the allocator (and the step's work lists)
                self._graph_body(g, ps)
            torch.cuda.current_stream().wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            pool = self._pool if disable_on_failure else torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                g.out = self._graph_body(g, ps)
            g.graph, g.step = graph, ps
            if g.toks is not None and RUN_GRAPH_STEPS > 1 and batch <= RUN_GRAPH_BATCH:
                g.multi = torch.cuda.CUDAGraph()  # its outputs are never read: greedy runs read `toks`
                with torch.cuda.graph(g.multi, pool=pool, capture_error_mode="thread_local"):
                    for _ in range(RUN_GRAPH_STEPS):
                        self._graph_body(g, ps)
            if keys:
                self._short[batch] = g
            elif rows == batch:
                self._graphs[(batch, tokens)] = g
            return g
        except (NotCapturable, RuntimeError) as exc:
            log.warning(
                "CUDA graph capture of a %d x %d step failed (%s: %s); %s run eagerly",
                batch,
                tokens,
                type(exc).__name__,
                exc,
                "steps" if disable_on_failure else "such steps",
            )
            if disable_on_failure:
                self._graph_batches = []
                self._graph_chunks = []
                self._graphs.clear()
                self._short.clear()
                self._pool = None
            repair_after_failed_capture(self._dev)
            return None
