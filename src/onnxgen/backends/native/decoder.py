"""NativeDecoder: an ONNX Runtime GenAI package's graph lowered to torch, with the KV owned by the runtime.

See `onnxgen.backends.base` for the Decoder contract. Specifics:
- `forward` returns the last position's logits as a 1-D float32 torch tensor on the device (a fresh
  tensor each call, never a view of a CUDA-graph buffer).
- KV lives in `onnxgen.kv.buffers.KVBuffers` (model dtype, on the device, written in place, capacity in
  power-of-two buckets from `kv_floor`); `rewind_to` is O(1).
- On CUDA, forwards of a graph whose attention ops are all fused (GroupQueryAttention or ai.onnx
  Attention without a mask input) replay CUDA graphs (`graphs.Graphs`, the runner's mechanism too): one
  per (step size, KV capacity bucket), where the step size is 1 for decode and, for a prefill chunk of
  n <= `graph_max_tokens` (1024) tokens, the next power of two >= max(n, 16) (the chunk is padded with
  copies of its last token; the padding's keys land past the valid length and are never read). The start
  position, the token ids and the index of the last real token are copied into device buffers first
  (pinned staging, no stream sync); a graph fed embeddings (a vision pipeline's) reads its embeddings and
  MRoPE positions from device buffers as well (`fed_inputs.FedInputs`, the padding a copy of the last
  token's). Decode graphs are captured on first use, prefill graphs on the
  second use of their shape (the first runs eagerly), so one-off prompt shapes never pay a capture.
  Every other forward runs the lowered program eagerly. int4 weights (MatMulNBits,
  GatherBlockQuantized) are dequantized once at load into the model's float dtype; `int4="packed"`
  keeps MatMulNBits packed (`device.int4_mode`).
- Threads: decoders may be driven from different threads at once. On CUDA every forward holds the
  device's lock (`device_lock`), so the work of different decoders never interleaves inside a graph
  capture, and captures run in thread-local mode, so work of other threads outside onnxgen cannot
  invalidate them. A capture that fails anyway (any error) disables graphs for that decoder, is logged
  once, and leaves the process's CUDA state usable (its RNG's capture bookkeeping is reset); the
  forward then runs eagerly. On the CPU forwards of different decoders run in parallel.
- `reset()` keeps the KV buffers, so the CUDA graphs captured on them stay valid; `close()` frees the
  buffers and drops the graphs. `fork()` shares the lowered program (the weights).
- LongRoPE (Phi-3.5, Phi-4-mini): the lowered graph reads the long rotary tables when the total length
  exceeds `Program.rope_switch` (`ops.rotary.rope_rows`, on the device in static steps), and cached keys keep
  the factors they were computed with. As the ort backend and transformers' Phi-3 do, a forward whose total
  is on the other side of the switch from the cached keys (growing past it, or after a rewind back below it)
  recomputes the whole context in that forward, and rows asked for on both sides of it (a verify step) are
  computed each in its own regime, so a session that grows past the switch equals a fresh run. The decoder
  keeps the cached token ids for that (LongRoPE packages only).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from onnxgen.backends.base import rope_parts
from onnxgen.backends.native.device import (
    Staging,
    device_lock,
    input_dtype,
    int4_mode,
    kv_dtype,
    shared_program,
    torch_device,
)
from onnxgen.backends.native.fed_inputs import FedInputs
from onnxgen.backends.native.graphs import GraphKey, Graphs
from onnxgen.backends.native.lowering import Program, describe
from onnxgen.backends.native.ops import RunCtx
from onnxgen.errors import (
    ContextOverflow,
    DeviceOutOfMemory,
    InvalidRequest,
    MissingRequiredInput,
    NotCapturable,
)
from onnxgen.kv.buffers import KVBuffers

log = logging.getLogger(__name__)


class NativeDecoder:
    """Decoder protocol over a lowered ONNX graph (backend "native").

    Options (declared in `onnxgen.backends.native.OPTIONS`): `kv_floor`: smallest KV capacity bucket.
    `cuda_graphs`: replay CUDA graphs on CUDA. `graph_max_tokens`: largest prefill chunk run as a static
    step, rounded up to a power of two (0: decode only; larger chunks run eagerly). `static_steps`
    (testing): run the static-shape steps CUDA graphs capture, load-time warm-up included, without
    capturing (works on the CPU).

    `info` keys beyond the contract's:
        program         a one-line description of the lowered graph
        int4            how int4 weights are handled ("dequantized at load" or "packed")
        load_s          seconds this decoder took to build
        warm_up_s       seconds of load-time warm-up (0.0 when the program was already warm: once per program)
        warmed_steps    static step sizes this decoder's warm-up compiled (empty when already warm)
        cuda_graphs     whether forwards replay CUDA graphs (turns False after a failed capture)
        static          whether forwards may run as static steps (CUDA graphs, or `static_steps`)
        graphs          the CUDA graphs held now, as sorted (step size, KV capacity) pairs
        static_forwards forwards run as static steps since load, by step size ({step size: count})
        eager_forwards  forwards run eagerly since load
        rope_switch     LongRoPE's threshold (None: no switch)
        rope_recomputes how many times the cache was recomputed at that threshold
    """

    backend = "native"
    can_rewind = True

    def __init__(
        self,
        spec: Any,
        device: str = "cpu",
        *,
        kv_floor: int = 256,
        cuda_graphs: bool = True,
        graph_max_tokens: int = 1024,
        static_steps: bool = False,
        int4: str | None = None,
        _program: Program | None = None,
    ) -> None:
        """`_program`: the lowered program to share (a fork's); None: the package's shared one."""
        t0 = time.perf_counter()
        self.spec = spec
        self.device = device
        self._dev = torch_device(device)
        int4 = int4_mode(int4)
        self._options = {
            "kv_floor": kv_floor,
            "cuda_graphs": cuda_graphs,
            "graph_max_tokens": graph_max_tokens,
            "static_steps": static_steps,
            "int4": int4,
        }
        dtype = kv_dtype(spec)
        self.program: Program = _program if _program is not None else shared_program(spec, self._dev, int4)
        self.kv = KVBuffers(
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_size,
            dtype,
            self._dev,
            floor=kv_floor,
            max_capacity=spec.context_length,
        )
        if graph_max_tokens < 0:
            raise InvalidRequest(
                f"graph_max_tokens must be >= 0, got {graph_max_tokens}", field="graph_max_tokens"
            )
        p = self.program
        self._in_ids = p.input_slots.get(spec.input_ids_name, -1)
        # a vision pipeline's decoder: fed `inputs_embeds` and MRoPE position ids `[3, 1, n]` by the pipeline
        self._in_embeds = p.input_slots.get(spec.inputs_embeds_name or "", -1)
        static_ok = p.static_ok and (self._in_ids >= 0 or self._in_embeds >= 0)
        self._use_graphs = bool(cuda_graphs) and device == "cuda" and static_ok
        self._static_steps = bool(static_steps) and static_ok
        self._graph_max = static_step_size(graph_max_tokens, 1 << 30) if graph_max_tokens > 1 else 1
        self._graphs: Graphs[None] = Graphs(self._dev)  # GraphKey("step", tokens=m, kv=capacity)
        self._seen: set[GraphKey] = set()
        self._graph_gen = -1
        self._staging = Staging(self._dev)
        self.device_lock = device_lock(self._dev)
        # device step buffer: [start, index of the last real token, token ids (padded)...]
        self._step_dev = torch.zeros(2 + self._graph_max, dtype=torch.int64, device=self._dev)
        self._arange = torch.arange(self._graph_max, dtype=torch.int64, device=self._dev)
        self._in_mask = p.input_slots.get(spec.attention_mask_name or "", -1)
        self._in_pos = p.input_slots.get(spec.position_ids_name or "", -1)
        self._mask_dtype = input_dtype(spec, spec.attention_mask_name, torch.int64)
        self._pos_dtype = input_dtype(spec, spec.position_ids_name, torch.int64)
        self._ids_dtype = input_dtype(spec, spec.input_ids_name, torch.int64)
        self._extra = [i for i in spec.extra_inputs if i.name in p.input_slots]
        fed = self._in_embeds >= 0 and static_ok and (self._use_graphs or self._static_steps)
        rows = self._graph_max if fed else 0
        self._fed = FedInputs(spec, self._in_embeds, self._in_pos, rows, self._pos_dtype, self._staging)
        self._static_forwards: dict[int, int] = {}
        self._eager_forwards = 0
        self._warmed: tuple[int, ...] = ()
        # LongRoPE: the ids whose KV the cache holds, and whether it was computed with the long tables
        self._held: list[int] = []
        self._rope_long = False
        self.rope_recomputes = 0
        warm_s = self._warm_up() if self._use_graphs or self._static_steps else 0.0
        self.load_seconds = time.perf_counter() - t0
        self._described = describe(p)
        self._load_info = {
            "int4": "dequantized at load" if int4 == "dense" else "packed",
            "load_s": round(self.load_seconds, 3),
            "warm_up_s": round(warm_s, 3),
        }
        log.info("native decoder: %s (load %.2fs)", self._described, self.load_seconds)

    # --- the seam ------------------------------------------------------------------------------

    def kv_len(self) -> int:
        return self.kv.length

    def rewind_to(self, n: int) -> bool:
        assert 0 <= n <= self.kv.length, f"rewind_to({n}) outside [0, {self.kv.length}]"
        self.kv.rewind_to(n)
        del self._held[n:]
        return True

    def reset(self) -> None:
        """Empty the cache; the buffers (and the CUDA graphs captured on them) stay."""
        self.kv.reset(free=False)
        self._held.clear()

    # --- memory and lifetime ----------------------------------------------------------------------

    def kv_bytes(self) -> int:
        return self.kv.nbytes()

    @property
    def info(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "device": self.device,
            "kv_dtype": self.spec.kv_dtype,
            "kv_capacity": self.kv.capacity,
            "weights": id(self.program),
            "program": self._described,
            **self._load_info,
            "warmed_steps": self._warmed,
            "cuda_graphs": self._use_graphs,
            "static": self._use_graphs or self._static_steps,
            "graphs": sorted((k.tokens, k.kv) for k in self._graphs),
            "static_forwards": dict(self._static_forwards),
            "eager_forwards": self._eager_forwards,
            "rope_switch": self.program.rope_switch,
            "rope_recomputes": self.rope_recomputes,
        }

    def export_kv(self) -> list[tuple[Any, Any]]:
        """`Decoder.export_kv`: host copies of the cached positions, per layer `[kv_heads, n, head_size]`."""
        with self.device_lock:
            return self.kv.export()

    def import_kv(self, tokens: Sequence[int], layers: Sequence[tuple[Any, Any]]) -> None:
        """`Decoder.import_kv`: the cache becomes `layers`, the KV of `tokens`."""
        self.reset()
        try:
            with self.device_lock:
                self.kv.load(layers)
        except torch.cuda.OutOfMemoryError as exc:  # pragma: cuda
            raise DeviceOutOfMemory(f"cannot allocate a KV cache of {len(tokens)} positions") from exc
        self._held = list(tokens)
        switch = self.program.rope_switch
        self._rope_long = switch is not None and len(tokens) > switch

    def close(self) -> None:
        """Empty the cache, free its buffers and drop the CUDA graphs; the decoder stays usable."""
        self._graphs.clear()
        self._seen.clear()
        self.kv.reset(free=True)
        self._held.clear()

    def fork(self) -> NativeDecoder:
        """A new decoder with an empty cache, the same options, sharing this one's lowered program."""
        return NativeDecoder(self.spec, self.device, **self._options, _program=self.program)

    # --- running --------------------------------------------------------------------------------

    def forward(
        self, tokens: Sequence[int], start_pos: int, inputs: Mapping[str, Any] | None = None, rows: int = 1
    ) -> torch.Tensor:
        assert start_pos == self.kv.length, f"start_pos {start_pos} != kv_len {self.kv.length}"
        switch = self.program.rope_switch
        if switch is None:
            return self._forward(tokens, start_pos, inputs, rows)
        parts = rope_parts(start_pos, len(tokens), rows, switch)
        outs = [self._forward_rope(tokens[a:b], start_pos + a, inputs, r) for a, b, r in parts]
        return outs[0] if len(outs) == 1 else torch.cat([o.reshape(-1, o.shape[-1]) for o in outs])

    def _forward_rope(
        self, tokens: Sequence[int], start_pos: int, inputs: Mapping[str, Any] | None, rows: int
    ) -> torch.Tensor:
        """`_forward` for a LongRoPE graph: recompute everything when the regime changes (see the module doc)."""
        switch = self.program.rope_switch
        assert switch is not None
        long = start_pos + len(tokens) > switch
        if start_pos and long != self._rope_long:
            # NOTE: the cached keys carry the other regime's rotary factors; recompute them all in this one
            # forward (a chunked recompute would run its first chunks in the short regime again).
            tokens = [*self._held[:start_pos], *tokens]
            self.kv.rewind_to(0)
            start_pos = 0
            self.rope_recomputes += 1
        out = self._forward(tokens, start_pos, inputs, rows)
        self._rope_long = long
        self._held[start_pos:] = list(tokens)
        return out

    def _forward(
        self, tokens: Sequence[int], start_pos: int, inputs: Mapping[str, Any] | None, rows: int
    ) -> torch.Tensor:
        n = len(tokens)
        assert n > 0, "forward needs at least one token"
        assert 1 <= rows <= n, f"rows={rows} outside [1, {n}]"
        total = start_pos + n
        if total > self.spec.context_length:
            raise ContextOverflow(total, self.spec.context_length)
        extra = self._extra_values(inputs)
        try:
            with self.device_lock:
                self.kv.reserve(total)
                static = rows == 1 and (not extra or self._fed.takes(extra))
                logits = self._static_forward(tokens, start_pos, extra) if static else None
                if logits is None:
                    logits = self._run_eager(tokens, start_pos, extra, rows)
                    self._eager_forwards += 1
        except torch.cuda.OutOfMemoryError as exc:  # pragma: cuda
            raise DeviceOutOfMemory(
                f"the device ran out of memory running {n} token(s) at position {start_pos}"
            ) from exc
        self.kv.set_length(total)
        return logits

    def _extra_values(self, inputs: Mapping[str, Any] | None) -> dict[int, torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        names = [io.name for io in self._extra]
        if self._in_embeds >= 0:
            names.append(self.spec.inputs_embeds_name)
            if inputs is not None and self.spec.position_ids_name in inputs:
                names.append(self.spec.position_ids_name)  # MRoPE's, given by the pipeline
        for name in names:
            if inputs is None or name not in inputs:
                hint = (
                    "the image pipeline (backends/multimodal.py) feeds it" if self._in_embeds >= 0 else None
                )
                raise MissingRequiredInput(name, hint)
            v = inputs[name]
            # host values stay there until used: an eager forward moves them, a static step uploads them
            out[self.program.input_slots[name]] = (
                v if isinstance(v, torch.Tensor) else torch.as_tensor(np.ascontiguousarray(v))
            )
        return out

    def _run_eager(
        self, tokens: Sequence[int], start: int, extra: dict[int, torch.Tensor], rows: int = 1
    ) -> torch.Tensor:
        n = len(tokens)
        env = self.program.new_env()
        if self._in_ids >= 0:
            ids = torch.empty(n, dtype=torch.int64, device=self._dev)
            self._staging.upload(torch.as_tensor(tokens, dtype=torch.int64), ids)
            env[self._in_ids] = ids.view(1, n).to(self._ids_dtype)
        positions = torch.arange(start, start + n, device=self._dev)
        if self._in_mask >= 0:
            env[self._in_mask] = torch.ones((1, start + n), dtype=self._mask_dtype)  # host: shape arithmetic
        if self._in_pos >= 0:
            env[self._in_pos] = positions.to(self._pos_dtype).unsqueeze(0)
        for s, t in extra.items():
            env[s] = t.to(self._dev)
        last = torch.arange(n - rows, n, device=self._dev) if rows > 1 else None  # logits of these positions
        ctx = RunCtx(self.kv, start, n, positions, last=last)
        out = self.program.execute(env, ctx)
        if rows > 1:
            return out.reshape(-1, out.shape[-1])[-rows:].to(torch.float32, copy=True)
        return _last_logits(out)

    # --- static steps and CUDA graphs ------------------------------------------------------------

    def _warm_up(self) -> float:
        """Compile, at load, every kernel variant static steps use (decode and prefill steps; one key
        split and several), so no request pays a Triton compile mid-conversation. Runs a few static
        steps eagerly on a small cache, then empties it. Once per lowered program (decoders share it).
        Returns the seconds spent."""
        t = time.perf_counter()
        done = self.program.info.setdefault("warmed_steps", set())
        steps = [m for m in (1, 64) if m <= self._graph_max and m not in done]  # prefill sizes compile alike
        if not steps:
            return 0.0
        try:
            for cap in (self.kv.floor, 2 * self.kv.floor):
                self.kv.reserve(min(cap, self.spec.context_length))
                for m in steps:
                    if m <= self.kv.capacity:
                        self._run_static([0] * m, 0, m)
        except NotCapturable as exc:  # the first capture will find out too and fall back to eager
            log.info("warm-up stopped: %s", exc)
        self.kv.set_length(0)
        if self._dev.type == "cuda":  # pragma: cuda
            torch.cuda.synchronize(self._dev)
        done.update(steps)
        self._warmed = tuple(steps)
        return time.perf_counter() - t

    def _static_forward(
        self, tokens: Sequence[int], start: int, extra: dict[int, torch.Tensor] | None = None
    ) -> torch.Tensor | None:
        """Run `tokens` as a static step (a CUDA graph replay on CUDA); None when it cannot be one. `extra`:
        a graph fed embeddings' embeddings and positions (`FedInputs.takes`), copied into the step's buffers."""
        if not (self._use_graphs or self._static_steps):
            return None
        n = len(tokens)
        m = static_step_size(n, self._graph_max)
        if m == 0 or start + m > self.kv.capacity:
            return None
        if not self._use_graphs:  # the captured code path, run eagerly (tests, CPU)
            logits = _last_logits(self._run_static(tokens, start, m, extra))
            self._count_static(m)
            return logits
        # pragma: cuda-begin (CUDA graphs)
        if self._graph_gen != self.kv.generation:
            # NOTE: the KV buffers were reallocated, so every captured graph is stale (`Graphs.clear`
            # also drops their memory pool's handle, which the next capture must not reuse).
            self._graphs.clear()
            self._seen.clear()
            self._graph_gen = self.kv.generation
        key = GraphKey("step", tokens=m, kv=self.kv.capacity)
        g = self._graphs.get(key)
        if g is None and m > 1 and key not in self._seen:
            self._seen.add(key)  # a prefill shape is captured on its second use
            return None
        self._set_step(tokens, start, m, extra)
        if g is None:
            try:
                g = self._graphs.capture(key, lambda: self.program.execute(*self._static_env(m)), None)
            except NotCapturable as exc:
                if m == 1:
                    log.warning("decode is not capturable (%s); running eagerly", exc)
                    self._use_graphs = False
                else:
                    log.warning("prefill chunks are not capturable (%s); running them eagerly", exc)
                    self._graph_max = 1
                return None
            except Exception as exc:  # the capture broke (e.g. a foreign synchronising call): go eager
                self._capture_failed(exc)
                return None
        g.replay()
        self._count_static(m)
        return _last_logits(g.out)
        # pragma: cuda-end

    def _count_static(self, m: int) -> None:
        self._static_forwards[m] = self._static_forwards.get(m, 0) + 1

    def _run_static(
        self, tokens: Sequence[int], start: int, m: int, extra: dict[int, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Run `tokens` at `start` as a static step of `m` positions, uncaptured; returns the program's
        logits output."""
        self._set_step(tokens, start, m, extra)
        env, ctx = self._static_env(m)
        return self.program.execute(env, ctx)

    def _set_step(
        self, tokens: Sequence[int], start: int, m: int, extra: dict[int, torch.Tensor] | None = None
    ) -> None:
        n = len(tokens)
        if extra:
            self._fed.stage(extra, n, m)
        step = torch.empty(2 + m, dtype=torch.int64)
        step[0], step[1] = start, n - 1
        step[2 : 2 + n] = torch.as_tensor(tokens, dtype=torch.int64)
        step[2 + n :] = int(tokens[-1])  # padding: a valid id; its keys land past the valid length
        self._staging.upload(step, self._step_dev[: 2 + m])

    def _static_env(self, m: int) -> tuple[list[Any], RunCtx]:
        env = self.program.new_env()
        if self._in_ids >= 0:
            env[self._in_ids] = self._step_dev[2 : 2 + m].view(1, m).to(self._ids_dtype)
        past = self._step_dev[0:1]
        positions = self._arange[:m] + past
        if self._in_embeds >= 0:
            self._fed.bind(env, m)
        elif self._in_pos >= 0:
            env[self._in_pos] = positions.view(1, m).to(self._pos_dtype)
        ctx = RunCtx(self.kv, -1, m, positions, past=past, last=self._step_dev[1:2] if m > 1 else None)
        return env, ctx

    def _capture_failed(self, exc: BaseException) -> None:  # pragma: cuda
        """After a capture that raised (`Graphs.capture` repaired what a broken capture leaves behind
        process-wide): disable graphs for this decoder (logged once), drop its graphs and their pool."""
        if self._use_graphs:
            log.warning(
                "CUDA graph capture failed (%s: %s); this decoder runs eagerly from now on",
                type(exc).__name__,
                exc,
            )
        self._use_graphs = False
        self._graphs.clear()
        self._seen.clear()


def _last_logits(out: torch.Tensor) -> torch.Tensor:
    """The last position's logits as a fresh 1-D float32 tensor (never a view of a graph's buffer)."""
    return out.reshape(-1, out.shape[-1])[-1].to(torch.float32, copy=True)


def static_step_size(n: int, largest: int) -> int:
    """The static step (CUDA graph shape) a forward of `n` tokens runs as: 1 for one token, else the next
    power of two >= max(n, 16), the chunk padded to it; 0 (no static step: run eagerly) when that exceeds
    `largest`. Not a KV capacity: that is `onnxgen.kv.buffers.capacity_bucket`."""
    if n == 1:
        return 1
    m = max(16, 1 << (n - 1).bit_length())
    return m if m <= largest else 0
