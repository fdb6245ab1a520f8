"""The batched native runner: the lowered program over a flattened ragged batch and a paged KV pool.

    runner = NativeRunner(spec, "cuda")             # the pool is allocated once, here
    logits = runner.run(BatchStep(...))              # [R, vocab] float32: one row per chunk that asks

A step's tokens run as one sequence of T positions (`[1, T]` through every per-token op: embeddings,
norms, projections, MLPs); the attention ops see the step's `PagedStep` (`RunCtx.paged`) and attend each
token over its own sequence's pages only; the lm_head sees only the rows whose logits are wanted. The
program is shared with the batch-1 `NativeDecoder`s of the package (one copy of the weights).

On CUDA, a step of decodes only (one token per sequence) replays a CUDA graph captured for its batch size
padded up to a bucket (`GRAPH_BATCHES`), a step that is one sequence's prefill chunk of up to 1024 tokens one
captured for its length padded up to the next size in `PREFILL_GRAPH_TOKENS` (with copies of its last token at
the following positions), and a step that verifies one sequence's draft tokens (logits for every fed position)
one of `VERIFY_GRAPH_TOKENS` positions, captured the first time one is needed. The graphs are
`graphs.Graphs` under `GraphKey`s; their inputs live in device buffers (`step_buffers.StepBuffers`: one upload
from pinned memory, no synchronisation; padding writes its keys into a scratch page outside the pool and its
logits are dropped); runs of decode steps follow `runs.replay_plan`. Mixed steps run eagerly. A failed
capture turns graphs off for the runner (a verify graph's: that size only), logged; the process stays usable.

LongRoPE (`rope_switch`): each sequence's tokens read the short or the long rotary tables by its length
(`SeqChunk.total`, else its end; `RunCtx.totals`: uploaded for eager steps, the KV lengths of a decode graph,
a device scalar set before a chunk graph's replay), so sequences on both sides of the switch share a batch.

A package can be batched when every KV-bound node is a fused attention op (GroupQueryAttention, or ai.onnx
Attention without a mask) and the graph needs no attention mask or extra inputs: `batchable(program,
spec)`. Other packages run one request per `NativeDecoder` (the engine decides).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

import onnxgen.envs as envs
from onnxgen.backends.batch import BatchStep, DeviceTokens, SeqChunk
from onnxgen.backends.native import paged
from onnxgen.backends.native.batching import batchable, computes_rowwise
from onnxgen.backends.native.device import (
    device_lock,
    input_dtype,
    kv_dtype,
    pool_pages,
    shared_program,
    torch_device,
)
from onnxgen.backends.native.graphs import Captured, GraphKey, Graphs
from onnxgen.backends.native.kernels.advance import copy_page_prefix, greedy_advance
from onnxgen.backends.native.ops import RunCtx
from onnxgen.backends.native.ops.attention import layer_windows
from onnxgen.backends.native.runs import PART_STEPS, DecodeRun, even_parts, replay_plan
from onnxgen.backends.native.step_buffers import RUN_TOKENS, StepBuffers
from onnxgen.errors import BackendUnavailable, DeviceOutOfMemory, InvalidRequest, NotCapturable
from onnxgen.kv.storage import PageStorage

log = logging.getLogger(__name__)

PAGE_SIZE = 16
GRAPH_BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # decode steps: sequences, padded up
# one sequence's prefill chunk: tokens, padded up (a turn of 65 tokens replays the 80-token step, not 128)
PREFILL_GRAPH_TOKENS = (16, 32, 48, 64, 80, 96, 128, 192, 256, 384, 512, 768, 1024)
VERIFY_GRAPH_TOKENS = (4, 8, 16)  # one sequence's last sample + drafts, a logits row per position
RUN_GRAPH_BATCH = 8  # decode graphs of more sequences: one step deep only (a step is long enough there)
# a batch size whose attention runs unpipelined up to at least this many keys (`paged.short_keys`) gets a
# second decode graph, replayed while its sequences stay that short
SHORT_GRAPH_KEYS = 1024


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
        part_steps: int = PART_STEPS,
        first_multi: bool = True,
        _program: Any = None,
        _pages: int | None = None,
    ) -> None:
        """`kv_bytes`: the pool's size in bytes (default: `device.pool_pages`'s share of the device). `cuda_graphs`: replay decode steps of up to `max_batch` sequences from
        CUDA graphs (captured at load). `int4`: MatMulNBits weights "dense" (dequantized at load) or "packed"
        (kept packed, `ops.quant`'s Int4Linear); None: `device.int4_mode`'s default (dense). `part_steps`: a
        run's tokens go to the host every this many steps and at its end, each part behind its own event, so
        the host can take a run's first steps while the device computes the rest (0: one part a run).
        `first_multi`: a run's first replay is the several-step graph too where it fits. Read from the
        environment here (`onnxgen.envs`): RUN_GRAPH_STEPS (decode graphs of up to `RUN_GRAPH_BATCH`
        sequences also captured that many steps deep, for greedy runs; 1: off) and ROWWISE (`computes_rowwise`).
        `_program`, `_pages`: a tensor-parallel rank's sharded program and the pool's pages every rank holds
        (`tp.runner`). Raises `BackendUnavailable` when the package cannot be batched, `DeviceOutOfMemory` when
        the pool cannot be allocated, `InvalidRequest` for a bad `part_steps`."""
        t0 = time.perf_counter()
        if not isinstance(part_steps, int) or isinstance(part_steps, bool) or part_steps < 0:
            raise InvalidRequest(f"part_steps must be an int >= 0, got {part_steps!r}", field="part_steps")
        self.spec = spec
        self.device = device
        self.part_steps = part_steps
        self._first_multi = bool(first_multi)
        self._depth = envs.read("RUN_GRAPH_STEPS")  # above RUN_TOKENS it would never fit a run
        self._rowwise_on = envs.read("ROWWISE")
        self._dev = torch_device(device)
        dtype = kv_dtype(spec)
        self.program = _program if _program is not None else shared_program(spec, self._dev, int4)
        self.rope_switch: int | None = self.program.rope_switch
        why = batchable(self.program, spec)
        if why is not None:
            raise BackendUnavailable(f"{spec.path}: cannot batch this package: {why}")
        # each layer's sliding window (0: the whole context); `kv_window`: the window every layer attends
        # within (0 when some layer reads the whole context), below which a sequence's pages are never read
        self.windows = layer_windows((st.node for st in self.program.steps), spec.num_layers)
        self.kv_window = max(self.windows) if min(self.windows, default=0) > 0 else 0
        kv_bytes, num_pages = pool_pages(spec, self._dev, page_size, dtype, kv_bytes, _pages)
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
        self._graphs: Graphs[StepBuffers] = Graphs(self._dev)
        # LongRoPE: a chunk graph's sequence length (`RunCtx.totals`), set before each replay of one
        self._rope_total = torch.zeros(1, dtype=torch.int64, device=self._dev)
        self._short: dict[int, int] = {}  # batch -> the KV bound of its short-context decode graph
        on = cuda_graphs and self._dev.type == "cuda"
        self._graph_batches = [b for b in GRAPH_BATCHES if b <= max_batch] if on else []
        if on and max_batch > GRAPH_BATCHES[-1]:
            self._graph_batches.append(max_batch)
        self._graph_chunks = [m for m in PREFILL_GRAPH_TOKENS if m <= spec.context_length] if on else []
        self.steps = {"graph": 0, "eager": 0, "multi": 0}  # "multi": replays of several-step graphs
        with self.device_lock:
            keys = [
                *(GraphKey("decode", b) for b in self._graph_batches),
                *(GraphKey("prefill", tokens=m) for m in self._graph_chunks),
            ]
            for key in keys:
                if not self.cuda_graphs:  # a capture failed: graphs are off
                    break
                self._capture(key)
            group = spec.num_heads // spec.num_kv_heads
            for b in self._graph_batches:  # decode graphs for short contexts: unpipelined attention
                kv = paged.short_keys(
                    b * spec.num_kv_heads, group, spec.head_size, spec.context_length, self._dev
                )
                if not self.cuda_graphs or kv < SHORT_GRAPH_KEYS or kv >= spec.context_length:
                    continue
                if self._capture(GraphKey("decode", b, kv=kv)) is not None:
                    self._short[b] = kv
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

    def _graph_for(self, step: BatchStep) -> Captured[StepBuffers] | None:
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
                return self._graphs.get(GraphKey("prefill", tokens=m))
        return None

    def _decode_graph(self, step: BatchStep, k: int) -> Captured[StepBuffers] | None:
        """The decode graph for `k` decode steps of `step`'s sequences: its batch padded up to a captured one,
        the short-context graph while every sequence's KV stays within its bound (it would compute longer
        ones right too, only slower: its attention unpipelined over longer splits)."""
        bucket = next((b for b in self._graph_batches if b >= len(step.seqs)), 0)
        kv = self._short.get(bucket)
        if kv is not None and max(s.start for s in step.seqs) + k <= kv:
            return self._graphs.get(GraphKey("decode", bucket, kv=kv))
        return self._graphs.get(GraphKey("decode", bucket))

    def _verify_graph(self, step: BatchStep) -> Captured[StepBuffers] | None:  # pragma: cuda
        """The verify graph for a step of one sequence whose every fed position wants logits, captured the
        first time its size is needed (a failure turns that size off, and nothing else); else None."""
        (s, *more) = step.seqs
        n = len(s.tokens)
        m = next((x for x in VERIFY_GRAPH_TOKENS if x >= n), 0)
        if more or s.logits != n or not m or s.start + m > self.spec.context_length:
            return None
        key = GraphKey("verify", tokens=m)
        g = self._graphs.get(key)
        if g is None and not self._graphs.failed(key):
            g = self._capture(key)
        return g

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
        parts as a run of greedy several-step replays would have them (`runs.even_parts`), so the host reads
        alike everywhere."""
        if run.parts:  # pragma: cuda
            return tuple(rows for rows, _ in run.parts)
        return even_parts(len(run.toks), self.part_steps)

    def collect_decodes(self, run: DecodeRun, rows: int | None = None) -> list[list[int]]:
        """`BatchRunner.collect_decodes`."""
        rows = len(run.toks) if rows is None else rows
        if run.parts:  # pragma: cuda
            next(done for end, done in run.parts if end >= rows).synchronize()
            return run.host[:rows].tolist()
        return run.toks[:rows].tolist()

    def _graph_decodes(
        self,
        g: Captured[StepBuffers],
        step: BatchStep,
        k: int,
        choose: Any,
        first: torch.Tensor | None,
        offset: int,
    ) -> DecodeRun:  # pragma: cuda
        """`k` decode steps as replays of the decode graph (`runs.replay_plan`): the first uploads the inputs
        (page tables for the whole run; `first`: its token ids on the device); each replay then chooses its
        greedy tokens and advances the inputs on the device (`_graph_body`), so the host only enqueues
        replays. Greedy rows take the tokens the graph recorded (and replay the several-step graph where the
        plan says); otherwise `choose` picks each step's tokens from the logits rows, which replace the greedy
        ids before the next replay. The tokens go to the host in parts (`DecodeRun.parts`)."""
        b, buf = len(step.seqs), g.inputs
        toks = torch.empty((k, b), dtype=torch.int64, device=self._dev)
        run = DecodeRun(toks, torch.empty((k, b), dtype=torch.int64, pin_memory=True))
        greedy = bool(getattr(choose, "greedy", False))
        rows = g.out.reshape(buf.batch, -1)[:b]
        plan = replay_plan(
            k,
            greedy,
            g.deep is not None,
            depth=g.depth,
            first_multi=self._first_multi,
            part_steps=self.part_steps,
        )
        for r in plan:
            if r.first == 0:
                self._run_graph(g, step, first, raw=True, run=k, multi=r.steps > 1)
            else:
                self._replay(g, r.steps > 1)
            if not greedy:
                toks[r.first] = choose(rows, offset + r.first)
                if r.first < k - 1:
                    buf.wide[:b].copy_(toks[r.first])
            elif r.flush is not None:
                toks[r.flush : r.last + 1] = buf.toks[: r.last + 1 - r.flush, :b]
            if r.part is not None:
                a, e = r.part.start, r.part.end
                src = (
                    toks[a:e] if r.part.from_run else buf.toks[a % RUN_TOKENS : (e - 1) % RUN_TOKENS + 1, :b]
                )
                self._stage_part(run, src, a, e)
        return run

    # --- eager -------------------------------------------------------------------------------------

    def _run_eager(self, step: BatchStep, ids_t: torch.Tensor | None = None) -> torch.Tensor:
        """`ids_t`: the step's token ids as a device tensor (they replace the chunks' `tokens`)."""
        t = step.num_tokens
        ps = paged.build_step(step, self.storage, self.page_size, self._dev)
        rowwise = computes_rowwise(step, self._rowwise_on)
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
        totals = None
        if self.rope_switch is not None:  # each token's sequence length (LongRoPE's regime)
            lens = [max(s.total, s.end) for s in step.seqs for _ in s.tokens]
            totals = torch.tensor(lens, dtype=torch.int64).to(self._dev, non_blocking=True)
        out = self.program.execute(
            env,
            RunCtx(self._rows, -1, t, ps.positions, last=ps.last, paged=ps, rowwise=rowwise, totals=totals),
        )
        self.steps["eager"] += 1
        return out.reshape(-1, out.shape[-1]).float()

    # --- CUDA graphs --------------------------------------------------------------------------------

    def _run_graph(
        self,
        g: Captured[StepBuffers],
        step: BatchStep,
        ids_t: torch.Tensor | None = None,
        raw: bool = False,
        run: int = 0,
        multi: bool = False,
    ) -> torch.Tensor:  # pragma: cuda
        """`ids_t`: a decode step's token ids as a device tensor `[B]` (copied in after the upload). `raw`: the
        logits as the graph's output rows in the model's dtype (a view, valid until the next replay; the
        device choice reads them exactly), not a float32 copy. `run`: the first of `run` decode steps whose
        later replays advance their inputs on the device (`_graph_decodes`; `StepBuffers.fill`). `multi`:
        replay the run's first steps as the several-step graph (the rows returned are then the last
        step's)."""
        buf, b = g.inputs, len(step.seqs)
        buf.fill(step, self.page_size, self._scratch, run)
        if self.rope_switch is not None and buf.tokens > 1:  # a chunk graph: its sequence's length
            self._rope_total.fill_(max(step.seqs[0].total, step.seqs[0].end))
        if ids_t is not None:
            buf.wide[:b].copy_(ids_t)
        assert not multi or run >= g.depth
        self._replay(g, multi)
        if buf.rows > 1 and buf.tokens > 1:  # a verify step: every real position's row
            return g.out.reshape(buf.rows, -1)[: len(step.seqs[0].tokens)].float()
        rows = g.out.reshape(buf.batch, -1)[:b]
        return rows if raw else rows.float()

    def _replay(self, g: Captured[StepBuffers], multi: bool = False) -> None:  # pragma: cuda
        """Replay `g`'s step, or with `multi` its several-step graph, and count the steps."""
        g.replay(deep=multi)
        if multi:
            self.steps["multi"] += 1
        self.steps["graph"] += g.depth if multi else 1

    def _graph_forward(self, buf: StepBuffers, ps: paged.PagedStep) -> torch.Tensor:  # pragma: cuda
        t = buf.batch * buf.tokens
        env = self.program.new_env()
        env[self._in_ids] = buf.wide[:t].view(1, t).to(self._ids_dtype)
        if self._in_pos >= 0:
            env[self._in_pos] = ps.positions.view(1, t).to(self._pos_dtype)
        # LongRoPE: a decode graph's sequences are as long as their KV after the step (moved on by the decode
        # advance); a chunk graph's one sequence as `_rope_total`
        totals = ps.seq_lens_t if buf.tokens == 1 else self._rope_total
        return self.program.execute(
            env,
            RunCtx(
                self._rows,
                -1,
                t,
                ps.positions,
                last=ps.last,
                paged=ps,
                static=True,
                rowwise=ps.per_token,
                totals=totals,
            ),
        )

    def _graph_body(self, buf: StepBuffers, ps: paged.PagedStep) -> torch.Tensor:  # pragma: cuda
        """What a graph runs: the forward step; a decode step then chooses each row's greedy token and
        advances its own inputs to the next decode step (`kernels.advance.greedy_advance`; with no live rows,
        the host fills every input before each replay, only a counter moves)."""
        out = self._graph_forward(buf, ps)
        if buf.toks is not None:
            greedy_advance(
                out.reshape(buf.batch, -1),
                buf.wide,
                buf.narrow,
                buf.toks,
                buf.batch,
                self._max_pages,
                self.page_size,
            )
        return out

    def _capture(self, key: GraphKey) -> Captured[StepBuffers] | None:  # pragma: cuda
        """Capture the step under `key` (all padding: harmless to run): "decode" (a logits row per sequence;
        `key.kv`: for KV lengths up to that, its attention unpipelined), "prefill" (one row), "verify" (a row
        per position, in a memory pool of its own, so a failure leaves the other graphs' pool alone). On
        failure log it and, but for a verify graph, turn graphs off for this runner; return None."""
        verify = key.kind == "verify"
        rows = key.tokens if verify else key.batch
        buf = StepBuffers.new(
            key.batch, key.tokens, rows, self._max_pages, self.page_size, self._scratch, self._dev, key.kv
        )
        deep = buf.toks is not None and self._depth > 1 and key.batch <= RUN_GRAPH_BATCH
        try:
            per_token = self._rowwise_on and rows > key.batch
            ps = buf.step = buf.paged_step(self.storage, self.page_size, self.spec.context_length, per_token)
            return self._graphs.capture(
                key,
                lambda: self._graph_body(buf, ps),
                buf,
                depth=self._depth if deep else 1,
                private_pool=verify,
            )
        except (NotCapturable, RuntimeError) as exc:
            log.warning(
                "CUDA graph capture of a %d x %d step failed (%s: %s); %s run eagerly",
                key.batch,
                key.tokens,
                type(exc).__name__,
                exc,
                "such steps" if verify else "steps",
            )
            if not verify:
                self._graph_batches = []
                self._graph_chunks = []
                self._graphs.clear()
                self._short.clear()
            return None
