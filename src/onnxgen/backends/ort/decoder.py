"""The onnxruntime backend: runs a package's decoder graph with an `InferenceSession` and IO binding.

Two KV modes, chosen from the graph at load:

- **shared** (builder packages whose attention is GroupQueryAttention, on CPU): one buffer per layer
  and K/V, `[1, kv_heads, capacity, head_size]`, bound as both `past_*` input and `present_*` output, so
  GroupQueryAttention writes the new keys/values in place (O(1) per token). The valid length is carried
  by `attention_mask` (GQA derives `seqlens_k`/`total_sequence_length` from it). `rewind_to(n)` only
  sets the length. Capacity grows in power-of-two buckets (floor `kv_floor`) by copying the valid prefix.
- **concat** (plain `past_key_values` graphs, or a non-CPU execution provider): `present_*` outputs are
  allocated by onnxruntime on the session's device and fed back as the next step's `past_*` (the graph
  concatenates). On CPU `rewind_to(n)` slices the cache; elsewhere it declines (the engine then resets).

KV never leaves the session's device between steps: on CPU the buffers are host arrays that the
OrtValues wrap without copying.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from onnxgen.errors import BackendUnavailable, DeviceOutOfMemory, InvalidRequest, MissingRequiredInput
from onnxgen.package.spec import ModelSpec

_NP_DTYPES: dict[str, Any] = {"float32": np.float32, "float16": np.float16}


def _np_dtype(name: str) -> Any:
    if name in _NP_DTYPES:
        return _NP_DTYPES[name]
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    raise BackendUnavailable(f"the ort backend cannot hold KV of dtype {name!r}")


def _last_position_graph(model: Any, logits_name: str) -> bool:
    """Rewrite `model` (in place) so the lm_head sees only the last position: a Slice of the hidden
    states before the MatMul that produces the logits (possibly through a Cast). Prefill then never
    computes a `[seq, vocab]` product. Returns False (model untouched) if the pattern is not found."""
    from onnx import TensorProto, helper

    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    node = producer.get(logits_name)
    if node is not None and node.op_type == "Cast":
        node = producer.get(node.input[0])
    if node is None or node.op_type not in ("MatMul", "MatMulNBits", "Gemm"):
        return False
    hidden = node.input[0]
    prefix = "/onnxgen/last_position"
    graph.initializer.extend([
        helper.make_tensor(f"{prefix}/starts", TensorProto.INT64, [1], [-1]),
        helper.make_tensor(f"{prefix}/ends", TensorProto.INT64, [1], [2**62]),
        helper.make_tensor(f"{prefix}/axes", TensorProto.INT64, [1], [1]),
    ])  # fmt: skip
    sliced = f"{prefix}/output"
    at = list(graph.node).index(node)
    graph.node.insert(at, helper.make_node("Slice", [hidden, f"{prefix}/starts", f"{prefix}/ends", f"{prefix}/axes"],
                                           [sliced], name=prefix))  # fmt: skip
    node.input[0] = sliced
    return True


def _open_session(spec: ModelSpec, opts: Any, providers: list[str], last_logits: bool) -> tuple[Any, bool, bool]:
    """Create the InferenceSession; returns (session, uses GroupQueryAttention, last-position logits)."""
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(spec.decoder_path), load_external_data=False)
    gqa = any(n.op_type == "GroupQueryAttention" for n in model.graph.node)
    if last_logits and _last_position_graph(model, spec.logits_name):
        # the graph comes from memory; its external weights stay in the package folder
        opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(spec.decoder_path.parent))
        return ort.InferenceSession(model.SerializeToString(), opts, providers=providers), gqa, True
    return ort.InferenceSession(str(spec.decoder_path), opts, providers=providers), gqa, False


def _bucket(n: int, floor: int, limit: int) -> int:
    cap = max(floor, 1)
    while cap < n:
        cap *= 2
    return min(cap, max(limit, n))


class OrtDecoder:
    """Decoder over onnxruntime (see module docstring). Batch 1, one sequence.

    `threads` sets intra-op threads (None: onnxruntime's default). `kv_mode` forces "shared" or
    "concat" (None: shared for GroupQueryAttention graphs on CPU). `last_logits` (default True)
    rewrites the graph in memory so the lm_head runs on the last position only.
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
        _shared: tuple[Any, str, bool] | None = None,
        **_: Any,
    ) -> None:
        import onnxruntime as ort

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
        elif device != "cpu":
            raise InvalidRequest(f"unknown device {device!r}; choose cpu or cuda", field="device")
        self._ort = ort
        if _shared is not None:  # a fork: same InferenceSession (weights), own KV
            self._session, kv_mode, self.last_logits = _shared
        else:
            opts = ort.SessionOptions()
            if threads:
                opts.intra_op_num_threads = threads
                opts.inter_op_num_threads = 1
            opts.log_severity_level = 3
            self._session, gqa, self.last_logits = _open_session(spec, opts, providers, last_logits)
            if kv_mode is None:
                kv_mode = "shared" if device == "cpu" and gqa else "concat"
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
        self._io: Any = None
        self._io_kv: Any = None
        self._len = 0
        self._cap = 0
        self._keys: list[np.ndarray] = []
        self._values: list[np.ndarray] = []
        self._kv_ov: list[Any] = []  # OrtValues: [k0, v0, k1, v1, ...]
        self.reset()

    # --- the KV seam -----------------------------------------------------------------------

    def kv_len(self) -> int:
        return self._len

    def kv_bytes(self) -> int:
        if self.kv_mode == "shared":
            return sum(a.nbytes for a in self._keys) + sum(a.nbytes for a in self._values)
        return sum(int(ov.tensor_size_in_bytes()) for ov in self._kv_ov) if self._len else 0

    def reset(self) -> None:
        """Empty the cache and free its memory."""
        self._len = 0
        self._cap = 0
        self._keys, self._values, self._kv_ov = [], [], []
        self._io = self._io_kv = None
        if self.kv_mode == "concat":
            self._set_concat_kv(None)

    def rewind_to(self, n: int) -> bool:
        assert 0 <= n <= self._len, f"rewind_to({n}) outside [0, {self._len}]"
        if n == self._len:
            return True
        if not self.can_rewind:
            return False
        if n == 0:
            self.reset()
            return True
        if self.kv_mode == "concat":
            arrays = [ov.numpy()[:, :, :n] for ov in self._kv_ov]
            self._set_concat_kv([np.ascontiguousarray(a) for a in arrays])
        self._len = n
        return True

    def fork(self) -> OrtDecoder:
        """A new decoder with an empty cache that shares this one's InferenceSession (weights)."""
        shared = (self._session, self.kv_mode, self.last_logits)
        return OrtDecoder(self.spec, self.device, kv_floor=self._kv_floor, _shared=shared)

    def close(self) -> None:
        self.reset()
        self._session = None  # type: ignore[assignment]

    # --- running ---------------------------------------------------------------------------

    def _set_concat_kv(self, arrays: list[np.ndarray] | None) -> None:
        spec = self.spec
        if arrays is None:
            empty = np.zeros((1, spec.num_kv_heads, 0, spec.head_size), dtype=self._dtype)
            arrays = [empty] * (2 * spec.num_layers)
        self._kv_ov = [self._ort.OrtValue.ortvalue_from_numpy(a) for a in arrays]
        self._hold = arrays  # keep the host arrays alive while OrtValues wrap them

    def _ensure_capacity(self, total: int) -> None:
        if total <= self._cap:
            return
        spec = self.spec
        cap = _bucket(total, self._kv_floor, spec.context_length)
        shape = (1, spec.num_kv_heads, cap, spec.head_size)
        try:
            keys = [np.zeros(shape, dtype=self._dtype) for _ in range(spec.num_layers)]
            values = [np.zeros(shape, dtype=self._dtype) for _ in range(spec.num_layers)]
        except MemoryError as exc:
            raise DeviceOutOfMemory(f"cannot allocate a KV cache of {cap} positions: {exc}") from exc
        if self._len:
            for old, new in zip(self._keys + self._values, keys + values, strict=True):
                new[:, :, : self._len] = old[:, :, : self._len]
        self._keys, self._values, self._cap = keys, values, cap
        ov = self._ort.OrtValue.ortvalue_from_numpy
        self._kv_ov = [x for k, v in zip(keys, values, strict=True) for x in (ov(k), ov(v))]

    def _bind_extra(self, io: Any, inputs: Mapping[str, Any] | None) -> None:
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

    def forward(self, tokens: Sequence[int], start_pos: int, inputs: Mapping[str, Any] | None = None) -> np.ndarray:
        """Feed `tokens` at `start_pos` (== kv_len()) and return the last position's float32 logits."""
        assert start_pos == self._len, f"forward at {start_pos} but the cache holds {self._len}"
        n = len(tokens)
        assert n > 0, "forward needs at least one token"
        spec = self.spec
        total = start_pos + n
        if self.kv_mode == "shared":
            self._ensure_capacity(total)
            io = self._shared_binding()
        else:
            io = self._session.io_binding()
        io.bind_cpu_input(spec.input_ids_name, np.asarray([tokens], dtype=np.int64))
        if spec.attention_mask_name in self._input_names:
            if self._ones.shape[1] < total:
                self._ones = np.ones((1, max(total, self._cap)), dtype=np.int64)
            io.bind_cpu_input(spec.attention_mask_name, self._ones[:, :total])
        if spec.position_ids_name in self._input_names:
            io.bind_cpu_input(spec.position_ids_name, np.arange(start_pos, total, dtype=np.int64)[None, :])
        self._bind_extra(io, inputs)
        # logits land in a host array we own (no per-step allocation for one-token steps)
        one_row = n == 1 or self.last_logits
        logits = self._step_logits if one_row else np.empty((1, n, spec.vocab_size), dtype=self._logits_dtype)
        io.bind_ortvalue_output(spec.logits_name, self._step_logits_ov if one_row else self._ort.OrtValue.ortvalue_from_numpy(logits))
        if self.kv_mode == "concat":
            for i in range(spec.num_layers):
                io.bind_ortvalue_input(spec.past_key_names[i], self._kv_ov[2 * i])
                io.bind_ortvalue_input(spec.past_value_names[i], self._kv_ov[2 * i + 1])
                io.bind_output(spec.present_key_names[i], self.device)
                io.bind_output(spec.present_value_names[i], self.device)
        try:
            self._session.run_with_iobinding(io)
        except Exception as exc:
            if "bad_alloc" in str(exc) or "Failed to allocate memory" in str(exc):
                raise DeviceOutOfMemory(f"onnxruntime ran out of memory on {self.device}: {exc}") from exc
            raise
        if self.kv_mode == "concat":
            # NOTE: outputs come back in binding order: logits, then k0, v0, k1, v1, ...
            self._kv_ov = list(io.get_outputs()[1:])
            self._hold = []
        self._len = total
        return np.array(logits[0, -1], dtype=np.float32)

    def _shared_binding(self) -> Any:
        """Shared mode's IO binding with every KV buffer bound as both past and present. Kept across
        steps; rebuilt only when the buffers change (capacity growth or reset)."""
        if self._io is None or self._io_kv is not self._kv_ov:
            io = self._session.io_binding()
            spec = self.spec
            for i in range(spec.num_layers):
                k, v = self._kv_ov[2 * i], self._kv_ov[2 * i + 1]
                io.bind_ortvalue_input(spec.past_key_names[i], k)
                io.bind_ortvalue_input(spec.past_value_names[i], v)
                io.bind_ortvalue_output(spec.present_key_names[i], k)
                io.bind_ortvalue_output(spec.present_value_names[i], v)
            self._io, self._io_kv = io, self._kv_ov
        return self._io

