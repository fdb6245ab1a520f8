"""One typed configuration for a loaded model: `onnxgen.load(path, config=None, **overrides)`.

    cfg = onnxgen.Config(model=onnxgen.ModelConfig(device="cuda"), scheduler=onnxgen.SchedulerConfig(max_running=32))
    model = onnxgen.load("pkg", cfg)                       # or, the same:
    model = onnxgen.load("pkg", device="cuda", max_running=32)

Four frozen sections, each field named once across them, so a flat keyword (`load(..., decode_steps=4)`)
names exactly one field (`Config.replace`):

    ModelConfig       backend, device and the backends' execution options (threads, int4, CUDA graphs ...)
    CacheConfig       the KV: paged pool or a decoder per request, pool size, sessions kept
    SchedulerConfig   requests at once, tokens per step, prefill chunk
    DecodingConfig    decode runs, speculation, the default generation length

A field left at None means "the default for this device and backend", decided in one place: the
`*_for` methods below. Every field is validated in `__post_init__`; a bad value raises `InvalidRequest`
naming the option. Environment variables (kernel switches) are not configuration: `onnxgen.envs`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from onnxgen.errors import InvalidRequest

BACKENDS = ("auto", "ort", "native")
DEVICES = ("cpu", "cuda")
SPECULATIVE = ("prompt_lookup", "off")
PREFILL_POLICIES = ("fair", "fifo")


def _positive(name: str, v: Any, *, optional: bool = True, least: int = 1) -> None:
    if v is None and optional:
        return
    if not isinstance(v, int) or isinstance(v, bool) or v < least:
        raise InvalidRequest(f"{name} must be an int >= {least}, got {v!r}", field=name)


def _choice(name: str, v: Any, choices: tuple[Any, ...]) -> None:
    if v not in choices:
        shown = ", ".join(repr(c) for c in choices)
        raise InvalidRequest(f"{name} must be one of {shown}, got {v!r}", field=name)


def _bool(name: str, v: Any, *, optional: bool = True) -> None:
    if v is None and optional:
        return
    if not isinstance(v, bool):
        raise InvalidRequest(f"{name} must be True or False, got {v!r}", field=name)


@dataclass(frozen=True)
class ModelConfig:
    """Where and how the graph runs.

    backend: "auto" (native on CUDA, ort on the CPU), "ort" or "native". device: "cpu" or "cuda".
    int4: MatMulNBits weights "dense" (dequantized at load, the default) or "packed" (native).
    threads: onnxruntime's intra-op threads (ort; None: its default). spinning: its threads spin between
    ops (ort). kv_mode: "shared" (GroupQueryAttention writes one buffer in place) or "concat" (ort; None:
    what the graph allows). last_logits: the lm_head on the last position only (ort; None: yes).
    cuda_graphs: replay decode steps and short prefill chunks from CUDA graphs (native on CUDA).
    graph_max_tokens: the longest prefill chunk replayed from a graph by a per-request decoder (native).
    static_steps: run every step with static shapes, as a CUDA graph would, also on the CPU (testing).
    part_steps: a run of decode steps reaches the host in parts of this many steps (native paged; None: 4).
    first_multi: a greedy run's first replay is a several-step graph where it fits (native on CUDA; None: yes).
    tool_parser: the tool-call format (hermes | llama3_json | mistral; None: detected from the template).
    tensor_parallel: ranks the native backend shards every layer over (docs/tensor-parallel.md): this process and
    N-1 workers it starts, gloo on the CPU, NCCL on CUDA (one device per rank); paged as with one process (1: off).
    warmup: run a synthetic burst at load (`engine.warmup`), so that first requests do not pay for kernels'
    first compilations and choices (None: on CUDA; it adds its run to the load time).
    """

    backend: str = "auto"
    device: str = "cpu"
    int4: str | None = None
    threads: int | None = None
    spinning: bool | None = None
    kv_mode: str | None = None
    last_logits: bool | None = None
    cuda_graphs: bool | None = None
    graph_max_tokens: int | None = None
    static_steps: bool | None = None
    part_steps: int | None = None
    first_multi: bool | None = None
    tool_parser: str | None = None
    warmup: bool | None = None
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        _choice("backend", self.backend, BACKENDS)
        _positive("tensor_parallel", self.tensor_parallel, optional=False)
        _choice("device", self.device, DEVICES)
        _choice("int4", self.int4, (None, "dense", "packed"))
        _positive("threads", self.threads)
        _choice("kv_mode", self.kv_mode, (None, "shared", "concat"))
        _positive("graph_max_tokens", self.graph_max_tokens, least=0)
        _positive("part_steps", self.part_steps, least=0)
        for name in ("spinning", "last_logits", "cuda_graphs", "static_steps", "first_multi", "warmup"):
            _bool(name, getattr(self, name))
        if self.tool_parser is not None and not isinstance(self.tool_parser, str):
            raise InvalidRequest(
                f"tool_parser must be a format name, got {self.tool_parser!r}", field="tool_parser"
            )

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def warmup_for(self) -> bool:
        """`warmup`, or its default on this device: on CUDA."""
        return self.cuda if self.warmup is None else self.warmup

    def resolved_backend(self) -> str:
        """The concrete backend: "auto" is native on CUDA, ort on the CPU."""
        if self.backend == "auto":
            return "native" if self.cuda else "ort"
        return self.backend


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache.

    paged: one paged pool shared by every request, batched, with a prefix index (None: when the backend
    can, i.e. native with fused attention; True: required; False: one decoder per request). kv_bytes: the
    pool's size (None: 2 GiB of address space on the CPU, 80 % of the free device memory on CUDA).
    page_size: tokens per page. kv_floor: the smallest capacity bucket of a per-request decoder's KV.
    max_sessions: sessions whose KV is kept at once (least recently used first out). max_kv_bytes: the
    most bytes sessions' kept KV may hold together (None: no bound but `max_sessions`). kv_dir: a folder where
    the sessions those bounds push out spill their KV as session files, resumed from at their next request
    (None: they recompute; `engine/spill.py`). kv_dir_bytes: the most bytes those files take together (least
    recently spilled deleted first). host_kv_bytes: host memory for KV that leaves the device (None: none;
    asked for where wanted, its copies costing the device time at each eviction; on the CPU the pool is host
    memory already, and the next tier is `kv_dir`). With paged KV it holds the pages the prefix index evicts
    and those of sessions pushed out, restored by a later request that continues their prefix (`kv/tiers.py`);
    with a decoder per request, the contexts of sessions pushed out (`engine/spill.py`).
    """

    paged: bool | None = None
    kv_bytes: int | None = None
    page_size: int | None = None
    kv_floor: int | None = None
    max_sessions: int = 8
    max_kv_bytes: int | None = None
    kv_dir: str | None = None
    kv_dir_bytes: int = 16 << 30
    host_kv_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.kv_dir is not None and not isinstance(self.kv_dir, str):
            raise InvalidRequest(f"kv_dir must be a folder's path (str), got {self.kv_dir!r}", field="kv_dir")
        _positive("kv_dir_bytes", self.kv_dir_bytes, optional=False)
        _positive("host_kv_bytes", self.host_kv_bytes, least=0)
        _bool("paged", self.paged)
        _positive("kv_bytes", self.kv_bytes)
        _positive("page_size", self.page_size)
        _positive("kv_floor", self.kv_floor)
        _positive("max_sessions", self.max_sessions, optional=False, least=0)
        _positive("max_kv_bytes", self.max_kv_bytes, least=0)

    def host_bytes_for(self, cuda: bool) -> int:
        """`host_kv_bytes`, or its default on this device."""
        return self.host_kv_bytes if self.host_kv_bytes is not None else 0


@dataclass(frozen=True)
class SchedulerConfig:
    """How many requests run at once and how much each step feeds.

    max_running: requests decoding at once (None: 64 on CUDA, 16 on the CPU with paged KV, 8 with a
    decoder per request). max_batch_tokens: tokens per step (None: 4096 on CUDA, 512 on the CPU with paged
    KV; unbounded with decoders). chunk_size: the longest prefill chunk (None: the package's, else whole).
    prefill_policy: how a step's tokens left after the decodes go to prompts (`engine/scheduler.py`): "fair"
    (running prefills take at most half while requests wait to be admitted, the oldest first, then the
    shortest left; what is left over goes back to them) or "fifo" (in admission order, then arrivals).
    """

    max_running: int | None = None
    max_batch_tokens: int | None = None
    chunk_size: int | None = None
    prefill_policy: str = "fair"

    def __post_init__(self) -> None:
        _positive("max_running", self.max_running)
        _positive("max_batch_tokens", self.max_batch_tokens)
        _positive("chunk_size", self.chunk_size)
        _choice("prefill_policy", self.prefill_policy, PREFILL_POLICIES)

    @property
    def fair(self) -> bool:
        """Whether prompts share a step's tokens fairly (`prefill_policy` "fair")."""
        return self.prefill_policy == "fair"

    def running_for(self, cuda: bool, paged: bool) -> int:
        """`max_running`, or its default on this device and KV kind."""
        if self.max_running is not None:
            return self.max_running
        return (64 if cuda else 16) if paged else 8

    def budget_for(self, cuda: bool, paged: bool) -> int:
        """`max_batch_tokens`, or its default on this device and KV kind."""
        if self.max_batch_tokens is not None:
            return self.max_batch_tokens
        return (4096 if cuda else 512) if paged else 1 << 40


@dataclass(frozen=True)
class DecodingConfig:
    """How tokens are produced.

    max_new_tokens: what a request generates when it names no limit. decode_steps: decode steps per host
    round trip with paged KV (None: 8 on CUDA, else 1). first_run_steps: steps of the run launched behind a
    prompt's last chunk, before its first token is read (0: `decode_steps`). launch_first: launch that run
    at all (None: on CUDA; on the CPU the first token would wait for it). speculative: "prompt_lookup"
    (draft from the context, verify in one forward: exactly plain decoding's output) or "off".
    speculate_alone: on CUDA a request drafts only while it runs alone (None: on CUDA; a verify step beside
    others' decodes runs outside their captured runs). spec_decode_steps: steps per run while a request of
    the run copies from its context or confirms a match.
    """

    max_new_tokens: int = 256
    decode_steps: int | None = None
    first_run_steps: int = 1
    launch_first: bool | None = None
    speculative: str = "prompt_lookup"
    speculate_alone: bool | None = None
    spec_decode_steps: int = 2

    def __post_init__(self) -> None:
        _positive("max_new_tokens", self.max_new_tokens, optional=False)
        _positive("decode_steps", self.decode_steps)
        _positive("first_run_steps", self.first_run_steps, optional=False, least=0)
        _bool("launch_first", self.launch_first)
        if self.speculative in (True, False):  # the Python API's booleans
            object.__setattr__(self, "speculative", "prompt_lookup" if self.speculative else "off")
        _choice("speculative", self.speculative, SPECULATIVE)
        _bool("speculate_alone", self.speculate_alone)
        _positive("spec_decode_steps", self.spec_decode_steps, optional=False)

    def steps_for(self, cuda: bool, paged: bool) -> int:
        """`decode_steps`, or its default on this device and KV kind."""
        if self.decode_steps is not None:
            return self.decode_steps
        return 8 if cuda and paged else 1

    def launch_first_for(self, cuda: bool) -> bool:
        return cuda if self.launch_first is None else self.launch_first

    def alone_for(self, cuda: bool) -> bool:
        return cuda if self.speculate_alone is None else self.speculate_alone


_SECTIONS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "decoding": DecodingConfig,
}


@dataclass(frozen=True)
class Config:
    """Everything `onnxgen.load()` takes beside the package path. Frozen: derive with `replace`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    decoding: DecodingConfig = field(default_factory=DecodingConfig)

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise InvalidRequest(f"Config.{name} must be a {cls.__name__}", field=name)

    @staticmethod
    def options() -> dict[str, str]:
        """Every flat option name and the section that holds it."""
        return {f.name: sec for sec, cls in _SECTIONS.items() for f in dataclasses.fields(cls)}

    def replace(self, **overrides: Any) -> Config:
        """A copy with flat options changed (`replace(device="cuda", max_running=8)`). Raises
        `InvalidRequest` naming an unknown option and listing the known ones, or a bad value."""
        where = self.options()
        by_section: dict[str, dict[str, Any]] = {}
        for name, value in overrides.items():
            sec = where.get(name)
            if sec is None:
                raise InvalidRequest(
                    f"unknown option {name!r}; load() takes {', '.join(sorted(where))}", field=name
                )
            by_section.setdefault(sec, {})[name] = value
        changed = {sec: dataclasses.replace(getattr(self, sec), **kw) for sec, kw in by_section.items()}
        return dataclasses.replace(self, **changed)

    def backend_options(self) -> dict[str, Any]:
        """The options the backends declare, those set (not None): what the decoder and runner are built with."""
        m, c = self.model, self.cache
        opts = {
            "threads": m.threads,
            "spinning": m.spinning,
            "kv_mode": m.kv_mode,
            "last_logits": m.last_logits,
            "cuda_graphs": m.cuda_graphs,
            "graph_max_tokens": m.graph_max_tokens,
            "static_steps": m.static_steps,
            "part_steps": m.part_steps,
            "first_multi": m.first_multi,
            "int4": m.int4,
            "tensor_parallel": m.tensor_parallel if m.tensor_parallel > 1 else None,
            "kv_floor": c.kv_floor,
            "kv_bytes": c.kv_bytes,
            "page_size": c.page_size,
        }
        return {k: v for k, v in opts.items() if v is not None}
