"""The onnxruntime backend: runs a package's decoder graph with an `InferenceSession` and IO binding.

Two KV modes, chosen from the graph at load:

- **shared** (builder packages whose attention is GroupQueryAttention, on CPU): one buffer per layer
  and K/V, `[1, kv_heads, capacity, head_size]`, bound as both `past_*` input and `present_*` output, so
  GroupQueryAttention writes the new keys/values in place (O(1) per token). The valid length is carried
  by `attention_mask` (GQA derives `seqlens_k`/`total_sequence_length` from it). `rewind_to(n)` only
  sets the length. The buffers are `onnxgen.kv.buffers.KVBuffers` of numpy arrays (the native backend's
  storage class, so capacity grows by the same power-of-two buckets from `kv_floor`, copying the valid
  prefix); `reset()` keeps them, `close()` frees them.
- **concat** (plain `past_key_values` graphs, or a non-CPU execution provider): `present_*` outputs are
  allocated by onnxruntime on the session's device and fed back as the next step's `past_*` (the graph
  concatenates). On CPU `rewind_to(n)` slices the cache; elsewhere it declines (the engine then resets).

KV never leaves the session's device between steps: on CPU the buffers are host arrays that the
OrtValues wrap without copying.

Two facts read from the graph at load (`GraphFacts`, `backends/ort/graph.py`):

- **Sliding windows**: GroupQueryAttention with `sliding_window_cache` (builder 0.18's windowed layers)
  needs every KV buffer to hold at least `local_window_size` positions, so the smallest capacity bucket
  is raised to the largest window (the user's `kv_floor` stays the floor below it). Buffers still grow
  with the context and never wrap, so rewinding stays O(1).
- **LongRoPE** (Phi-3.5, Phi-4-mini): the builder's graph picks short or long rotary caches by the total
  length (`If(attention_mask.shape[1] > original_max_position_embeddings)`), and keys already cached keep
  the factors they were computed with. As transformers does (`Phi3ForCausalLM.prepare_inputs_for_generation`),
  the decoder recomputes the whole cache when a step changes the regime (growing past the threshold, or a
  rewind back below it), so a session that grows past it equals a fresh run. It keeps the cached token ids
  for that (LongRoPE packages only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from onnxgen.backends.base import rope_parts
from onnxgen.backends.ort.graph import LOGITS_FROM, GraphFacts, open_session
from onnxgen.errors import (
    BackendUnavailable,
    ContextOverflow,
    DeviceOutOfMemory,
    InvalidRequest,
    MissingRequiredInput,
)
from onnxgen.kv.buffers import KVBuffers, capacity_bucket
from onnxgen.kv.storage import from_host, host_copy
from onnxgen.package.spec import ModelSpec

_NP_DTYPES: dict[str, Any] = {"float32": np.float32, "float16": np.float16}


def _np_dtype(name: str) -> Any:
    if name in _NP_DTYPES:
        return _NP_DTYPES[name]
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    raise BackendUnavailable(f"the ort backend cannot hold KV of dtype {name!r}")


class OrtDecoder:
    """Decoder over onnxruntime (see the module docstring; the contract is `onnxgen.backends.base`'s).
    Batch 1, one sequence.

    Options (declared in `onnxgen.backends.ort.OPTIONS`): `threads` sets intra-op threads (None:
    onnxruntime's default). `kv_floor`: smallest KV capacity bucket (shared mode; raised to the graph's
    largest sliding window, which GroupQueryAttention needs the buffers to hold). `kv_mode` forces
    "shared" or "concat" (None: shared for GroupQueryAttention graphs on CPU). `last_logits` (default
    True) rewrites the graph in memory so the lm_head runs on the last position only. `spinning` (default
    False) lets intra-op threads spin-wait between ops: slightly faster on a machine with idle cores,
    much slower when another process competes for them.

    `info` keys beyond the contract's: `kv_mode` ("shared" | "concat"), `last_logits` (bool: the graph
    was rewritten to compute the last position's logits only), `window` (the largest sliding window, 0:
    none), `rope_switch` (LongRoPE's threshold, None: no switch) and `rope_recomputes` (how many times
    the cache was recomputed at that threshold).
    """

    backend = "ort"

    def __init__(
        self,
        spec: ModelSpec,
        device: str = "cpu",
        *,
        threads: int | None = None,
        kv_floor: int = 256,
        kv_mode: str | None = None,
        last_logits: bool = True,
        spinning: bool = False,
        _shared: tuple[Any, str, bool, GraphFacts] | None = None,
    ) -> None:
        import onnxruntime as ort

        assert device in ("cpu", "cuda"), f"device {device!r} was not checked (resolve_backend)"
        self.spec = spec
        self.device = device
        providers = ["CPUExecutionProvider"]
        if device == "cuda":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise BackendUnavailable(
                    "this onnxruntime build has no CUDA execution provider; use backend='native' on CUDA "
                    "(or install onnxruntime-gpu)"
                )
            providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
        self._ort = ort
        if _shared is not None:  # a fork: same InferenceSession (weights), own KV
            self._session, kv_mode, self.last_logits, self.facts = _shared
        else:
            opts = ort.SessionOptions()
            if threads:
                opts.intra_op_num_threads = threads
                opts.inter_op_num_threads = 1
            opts.log_severity_level = 3
            # Threads that spin between ops win a little on an idle machine and lose much more when another
            # process wants a core (docs/benchmarks/cpu.md); blocks handed out in shrinking sizes
            # (dynamic_block_base) let a descheduled thread's share be taken by the others.
            opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
            opts.add_session_config_entry("session.dynamic_block_base", "4")
            self._session, self.facts, self.last_logits = open_session(spec, opts, providers, last_logits)
            if kv_mode is None:
                kv_mode = "shared" if device == "cpu" and self.facts.gqa else "concat"
        self._dtype = _np_dtype(spec.kv_dtype)
        self._kv_floor = kv_floor
        if kv_mode not in ("shared", "concat"):
            raise InvalidRequest(f"kv_mode must be 'shared' or 'concat', got {kv_mode!r}", field="kv_mode")
        self.kv_mode = kv_mode
        self.can_rewind = device == "cpu"
        self._input_names = {i.name for i in self._session.get_inputs()}
        self._extra = [i for i in spec.extra_inputs if i.name in self._input_names]
        logits_io = next(o for o in spec.outputs if o.name == spec.logits_name)
        self._logits_dtype = _np_dtype(logits_io.dtype)
        self._step_logits = np.empty((1, 1, spec.vocab_size), dtype=self._logits_dtype)
        self._step_logits_ov = ort.OrtValue.ortvalue_from_numpy(self._step_logits)
        self._ones = np.ones((1, 0), dtype=np.int64)
        self._logits_from = _LogitsFrom()
        # shared mode: capacity buffers, and an IO binding over them kept until they are reallocated
        self._kv: KVBuffers | None = None
        if kv_mode == "shared":
            self._kv = KVBuffers(
                spec.num_layers,
                spec.num_kv_heads,
                spec.head_size,
                self._dtype,
                "cpu",
                floor=max(kv_floor, self.facts.window),
                max_capacity=spec.context_length,
                alloc=self._alloc,
            )
        self._io: Any = None
        self._io_gen = -1
        self._io_ov: list[Any] = []
        # concat mode: the last step's present_* OrtValues ([k0, v0, k1, v1, ...]) and their length
        self._concat_ov: list[Any] = []
        self._concat_len = 0
        self._hold: list[np.ndarray] = []
        if kv_mode == "concat":
            self._set_concat_kv(None, 0)
        # LongRoPE: the ids whose KV the cache holds, and whether it was computed with the long factors
        self._held: list[int] = []
        self._rope_long = False
        self.rope_recomputes = 0

    # --- the KV seam -----------------------------------------------------------------------

    def kv_len(self) -> int:
        return self._kv.length if self._kv is not None else self._concat_len

    def rewind_to(self, n: int) -> bool:
        held = self.kv_len()
        assert 0 <= n <= held, f"rewind_to({n}) outside [0, {held}]"
        if n == held:
            return True
        if not self.can_rewind:
            return False
        del self._held[n:]
        if self._kv is not None:
            self._kv.rewind_to(n)
        elif n == 0:
            self._set_concat_kv(None, 0)
        else:
            self._set_concat_kv([np.ascontiguousarray(ov.numpy()[:, :, :n]) for ov in self._concat_ov], n)
        return True

    def reset(self) -> None:
        """Empty the cache; shared mode keeps its buffers (and the IO binding over them)."""
        self._held.clear()
        if self._kv is not None:
            self._kv.reset()
        else:
            self._set_concat_kv(None, 0)

    # --- memory and lifetime -----------------------------------------------------------------

    def kv_bytes(self) -> int:
        if self._kv is not None:
            return self._kv.nbytes()
        return sum(int(ov.tensor_size_in_bytes()) for ov in self._concat_ov) if self._concat_len else 0

    def export_kv(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """`Decoder.export_kv`: host copies of the cached positions, per layer `[kv_heads, n, head_size]`."""
        if self._kv is not None:
            return self._kv.export()
        n, ovs = self._concat_len, self._concat_ov
        return [
            (host_copy(ovs[2 * i].numpy()[0, :, :n]), host_copy(ovs[2 * i + 1].numpy()[0, :, :n]))
            for i in range(self.spec.num_layers)
        ]

    def import_kv(self, tokens: Sequence[int], layers: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        """`Decoder.import_kv`: the cache becomes `layers`, the KV of `tokens`."""
        n = len(tokens)
        self.reset()
        if self._kv is not None:
            try:
                self._kv.load(layers)
            except MemoryError as exc:
                raise DeviceOutOfMemory(f"cannot allocate a KV cache of {n} positions: {exc}") from exc
        else:
            like = np.empty(0, dtype=self._dtype)
            arrays = [np.ascontiguousarray(from_host(a, like)[None]) for kv in layers for a in kv]
            self._set_concat_kv(arrays, n)
        self._held = list(tokens)
        switch = self.facts.rope_switch
        self._rope_long = switch is not None and n > switch

    @property
    def info(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "device": self.device,
            "kv_dtype": self.spec.kv_dtype,
            "kv_capacity": self._kv.capacity if self._kv is not None else self._concat_len,
            "weights": id(self._session),
            "kv_mode": self.kv_mode,
            "last_logits": self.last_logits,
            "window": self.facts.window,
            "rope_switch": self.facts.rope_switch,
            "rope_recomputes": self.rope_recomputes,
        }

    def close(self) -> None:
        """Empty the cache and free its buffers; the decoder stays usable (the InferenceSession is kept:
        forks share it)."""
        self._held.clear()
        if self._kv is not None:
            self._io, self._io_ov = None, []  # NOTE: the binding points into the buffers freed next
            self._kv.reset(free=True)
        else:
            self._set_concat_kv(None, 0)

    def fork(self) -> OrtDecoder:
        """A new decoder with an empty cache that shares this one's InferenceSession (weights)."""
        shared = (self._session, self.kv_mode, self.last_logits, self.facts)
        return OrtDecoder(self.spec, self.device, kv_floor=self._kv_floor, _shared=shared)

    # --- running ---------------------------------------------------------------------------

    def _alloc(self, shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, dtype=self._dtype)

    def _set_concat_kv(self, arrays: list[np.ndarray] | None, n: int) -> None:
        spec = self.spec
        if arrays is None:
            empty = np.zeros((1, spec.num_kv_heads, 0, spec.head_size), dtype=self._dtype)
            arrays = [empty] * (2 * spec.num_layers)
        self._concat_ov = [self._ort.OrtValue.ortvalue_from_numpy(a) for a in arrays]
        self._concat_len = n
        self._hold = arrays  # keep the host arrays alive while OrtValues wrap them

    def _bind_extra(self, io: Any, inputs: Mapping[str, Any] | None) -> None:
        embeds = self.spec.inputs_embeds_name
        if embeds is not None and embeds in self._input_names:  # a vision pipeline's decoder
            value = None if inputs is None else inputs.get(embeds)
            if value is None:
                raise MissingRequiredInput(embeds, "the image pipeline (backends/multimodal.py) feeds it")
            io.bind_cpu_input(embeds, np.ascontiguousarray(value))
        for gi in self._extra:
            value = None if inputs is None else inputs.get(gi.name)
            if value is None:
                raise MissingRequiredInput(gi.name)
            if isinstance(value, bytes | bytearray):
                raise InvalidRequest(
                    f"input {gi.name!r} is raw bytes; the ort backend needs an array of dtype {gi.dtype}",
                    field=gi.name,
                )
            io.bind_cpu_input(gi.name, np.ascontiguousarray(value))

    def forward(
        self, tokens: Sequence[int], start_pos: int, inputs: Mapping[str, Any] | None = None, rows: int = 1
    ) -> np.ndarray:
        """Feed `tokens` at `start_pos` (== kv_len()) and return the last position's float32 logits (the
        last `rows` positions' as `[rows, vocab]` when rows > 1).

        LongRoPE packages: when `start_pos + len(tokens)` is on the other side of the switch from the
        cached keys, the whole context is recomputed in this call (see the module docstring); rows asked
        for on both sides of it are computed each in its own regime."""
        assert start_pos == self.kv_len(), f"forward at {start_pos} but the cache holds {self.kv_len()}"
        switch = self.facts.rope_switch
        if switch is None:
            return self._forward(tokens, start_pos, inputs, rows)
        parts = rope_parts(start_pos, len(tokens), rows, switch)
        outs = [self._forward_rope(tokens[a:b], start_pos + a, inputs, r) for a, b, r in parts]
        return outs[0] if len(outs) == 1 else np.concatenate([o.reshape(-1, o.shape[-1]) for o in outs])

    def _forward_rope(
        self, tokens: Sequence[int], start_pos: int, inputs: Mapping[str, Any] | None, rows: int
    ) -> np.ndarray:
        """`_forward` for a LongRoPE graph: recompute everything when the regime changes (see `forward`)."""
        assert self.facts.rope_switch is not None
        long = start_pos + len(tokens) > self.facts.rope_switch
        if start_pos and long != self._rope_long:
            # NOTE: cached keys carry the other regime's rotary factors; recompute them all in this one
            # forward (a chunked recompute would run its first chunks in the short regime again).
            tokens = [*self._held, *tokens]
            self._empty()
            start_pos = 0
            self.rope_recomputes += 1
        out = self._forward(tokens, start_pos, inputs, rows)
        self._rope_long = long
        self._held[start_pos:] = list(tokens)
        return out

    def _empty(self) -> None:
        self._held = []
        if self._kv is not None:
            self._kv.rewind_to(0)
        else:
            self._set_concat_kv(None, 0)

    def _forward(
        self, tokens: Sequence[int], start_pos: int, inputs: Mapping[str, Any] | None, rows: int
    ) -> np.ndarray:
        n = len(tokens)
        assert n > 0, "forward needs at least one token"
        assert 1 <= rows <= n, f"rows={rows} outside [1, {n}]"
        spec = self.spec
        total = start_pos + n
        if total > spec.context_length:
            raise ContextOverflow(total, spec.context_length)
        if self._kv is not None:
            try:
                self._kv.reserve(total)
            except MemoryError as exc:
                cap = capacity_bucket(total, self._kv.floor, self._kv.max_capacity)
                raise DeviceOutOfMemory(f"cannot allocate a KV cache of {cap} positions: {exc}") from exc
            io = self._shared_binding()
            cap = self._kv.capacity
        else:
            io = self._session.io_binding()
            cap = total
        if spec.input_ids_name in self._input_names:
            io.bind_cpu_input(spec.input_ids_name, np.asarray([tokens], dtype=np.int64))
        if spec.attention_mask_name in self._input_names:
            if self._ones.shape[1] < total:
                self._ones = np.ones((1, max(total, cap)), dtype=np.int64)
            io.bind_cpu_input(spec.attention_mask_name, self._ones[:, :total])
        if spec.position_ids_name in self._input_names:
            given = (
                None if inputs is None else inputs.get(spec.position_ids_name)
            )  # MRoPE's, from the pipeline
            pos = np.arange(start_pos, total, dtype=np.int64)[None, :] if given is None else given
            io.bind_cpu_input(spec.position_ids_name, np.ascontiguousarray(pos, dtype=np.int64))
        self._bind_extra(io, inputs)
        if self.last_logits:
            io.bind_cpu_input(LOGITS_FROM, self._logits_from[rows])
        # logits land in a host array we own (no per-step allocation for one-token steps)
        one_row = n == 1 or (self.last_logits and rows == 1)
        shape = (1, rows if self.last_logits else n, spec.vocab_size)
        logits = self._step_logits if one_row else np.empty(shape, dtype=self._logits_dtype)
        io.bind_ortvalue_output(
            spec.logits_name,
            self._step_logits_ov if one_row else self._ort.OrtValue.ortvalue_from_numpy(logits),
        )
        if self._kv is None:
            for i in range(spec.num_layers):
                io.bind_ortvalue_input(spec.past_key_names[i], self._concat_ov[2 * i])
                io.bind_ortvalue_input(spec.past_value_names[i], self._concat_ov[2 * i + 1])
                io.bind_output(spec.present_key_names[i], self.device)
                io.bind_output(spec.present_value_names[i], self.device)
        try:
            self._session.run_with_iobinding(io)
        except Exception as exc:
            if "bad_alloc" in str(exc) or "Failed to allocate memory" in str(exc):
                raise DeviceOutOfMemory(f"onnxruntime ran out of memory on {self.device}: {exc}") from exc
            raise
        if self._kv is None:
            # NOTE: outputs come back in binding order: logits, then k0, v0, k1, v1, ...
            self._concat_ov = list(io.get_outputs()[1:])
            self._concat_len = total
            self._hold = []
        else:
            self._kv.set_length(total)
        if rows > 1:
            return np.array(logits[0, -rows:], dtype=np.float32)
        return np.array(logits[0, -1], dtype=np.float32)

    def _shared_binding(self) -> Any:
        """Shared mode's IO binding with every KV buffer bound as both past and present. Kept across
        steps; rebuilt only when `KVBuffers` reallocates (its `generation` changes)."""
        kv = self._kv
        assert kv is not None
        if self._io is None or self._io_gen != kv.generation:
            io = self._session.io_binding()
            spec = self.spec
            ov = self._ort.OrtValue.ortvalue_from_numpy
            held = []
            for i in range(spec.num_layers):
                k, v = ov(kv.keys[i]), ov(kv.values[i])
                io.bind_ortvalue_input(spec.past_key_names[i], k)
                io.bind_ortvalue_input(spec.past_value_names[i], v)
                io.bind_ortvalue_output(spec.present_key_names[i], k)
                io.bind_ortvalue_output(spec.present_value_names[i], v)
                held += (k, v)
            self._io, self._io_gen, self._io_ov = io, kv.generation, held
        return self._io


class _LogitsFrom(dict):
    """rows -> the `LOGITS_FROM` array `[-rows]`, made once per row count."""

    def __missing__(self, rows: int) -> np.ndarray:
        self[rows] = a = np.array([-rows], dtype=np.int64)
        return a
