"""Read an ONNX Runtime GenAI model folder into a frozen, validated `ModelSpec`.

The folder holds `genai_config.json`, the decoder graph (`model.decoder.filename`, possibly with
external data), `tokenizer.json`, `tokenizer_config.json` and optionally `chat_template.jinja`.
Reading a package never runs anything: the graph is opened without its weights, only to learn
its inputs, outputs and KV dtype.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onnxgen.errors import (
    InvalidConfig,
    MissingModelFile,
    MissingTokenizer,
    PackageNotFound,
    UnsupportedModel,
)
from onnxgen.package.multimodal import MultimodalSpec, read_multimodal

# Decoder-only model types ONNX Runtime GenAI's builder emits with one decoder graph.
SUPPORTED_MODEL_TYPES = frozenset(
    {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "phi",
        "phi3",
        "phimoe",
        "gemma",
        "gemma2",
        "gemma3_text",
        "granite",
        "olmo",
        "nemotron",
        "smollm3",
        "chatglm",
        "ernie4_5",
        "gptoss",
        "decoder",
        "qwen2_5_vl",  # the decoder of a vision pipeline (package/multimodal.py)
    }
)

# ONNX TensorProto element type -> numpy-style dtype name.
ONNX_DTYPES = {
    1: "float32",
    10: "float16",
    16: "bfloat16",
    11: "float64",
    7: "int64",
    6: "int32",
    9: "bool",
    2: "uint8",
}

# Inputs every decoder is fed by the runtime itself (others must come from the request).
_RUNTIME_INPUT_KEYS = ("input_ids", "attention_mask", "position_ids")


@dataclass(frozen=True)
class GraphIO:
    """One graph input or output: name, element dtype name and shape (ints or symbolic names)."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]


@dataclass(frozen=True)
class SearchDefaults:
    """The package's `search` section: defaults for sampling and length."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    max_length: int | None = None
    past_present_share_buffer: bool = False


@dataclass(frozen=True)
class ModelSpec:
    """Everything onnxgen knows about a package, validated at load. Immutable.

    Derived values are properties. `chunk_size` is the package's preference; an engine option
    overrides it (see `with_chunk_size`).
    """

    path: Path
    model_type: str
    decoder_path: Path
    inputs: tuple[GraphIO, ...]
    outputs: tuple[GraphIO, ...]
    input_ids_name: str
    attention_mask_name: str | None
    position_ids_name: str | None
    logits_name: str
    past_key_names: tuple[str, ...]
    past_value_names: tuple[str, ...]
    present_key_names: tuple[str, ...]
    present_value_names: tuple[str, ...]
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    hidden_size: int
    vocab_size: int
    context_length: int
    kv_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    search: SearchDefaults
    chunk_size: int | None
    tokenizer_path: Path
    tokenizer_config: dict[str, Any] = field(hash=False, compare=False)
    chat_template: str | None
    config: dict[str, Any] = field(hash=False, compare=False, repr=False)
    # the decoder's `inputs_embeds` input (a vision pipeline's: it then has no `input_ids`), and the pipeline
    inputs_embeds_name: str | None = None
    multimodal: MultimodalSpec | None = None

    def __post_init__(self) -> None:
        assert len(self.past_key_names) == self.num_layers == len(self.present_key_names)
        assert self.num_heads % self.num_kv_heads == 0, "heads must be a multiple of kv heads"

    @property
    def kv_layout(self) -> str:
        """KV tensors are `[batch, kv_heads, seq, head_size]` ("BNSH"), as the builder emits."""
        return "BNSH"

    @property
    def extra_inputs(self) -> tuple[GraphIO, ...]:
        """Graph inputs the runtime does not feed itself; each must come from the request."""
        own = {self.input_ids_name, self.attention_mask_name, self.position_ids_name}
        if self.multimodal is not None:  # the image pipeline feeds the embeddings
            own.add(self.inputs_embeds_name)
        own.update(self.past_key_names, self.past_value_names)
        return tuple(i for i in self.inputs if i.name not in own)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers."""
        item = {"float32": 4, "float16": 2, "bfloat16": 2}.get(self.kv_dtype, 4)
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * item

    def with_chunk_size(self, chunk_size: int | None) -> ModelSpec:
        """Return a copy whose `chunk_size` is overridden (None keeps the package's)."""
        if chunk_size is None:
            return self
        if chunk_size < 1:
            raise InvalidConfig(f"chunk_size must be >= 1, got {chunk_size}", self.path, "chunk_size")
        from dataclasses import replace

        return replace(self, chunk_size=chunk_size)


def _get(
    cfg: dict[str, Any], dotted: str, path: Path, kind: type | tuple[type, ...], default: Any = ...
) -> Any:
    """Read `a.b.c` from a nested dict, raising InvalidConfig naming the key when missing or mistyped."""
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            if default is not ...:
                return default
            raise InvalidConfig(
                f"{path}: genai_config.json has no key '{dotted}'; add it (see ONNX Runtime GenAI's config format)",
                path,
                dotted,
            )
        node = node[part]
    if not isinstance(node, kind) or (kind is int and isinstance(node, bool)):
        want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise InvalidConfig(
            f"{path}: genai_config.json key '{dotted}' must be {want}, got {node!r}", path, dotted
        )
    return node


def _layer_names(pattern: str, n: int, key: str, path: Path) -> tuple[str, ...]:
    if "%d" not in pattern:
        raise InvalidConfig(
            f"{path}: '{key}' must contain '%d' (one name per layer), got {pattern!r}", path, key
        )
    return tuple(pattern % i for i in range(n))


def _read_graph_io(onnx_path: Path) -> tuple[tuple[GraphIO, ...], tuple[GraphIO, ...], list[str]]:
    """Return the graph's inputs, outputs and the external data files it references (weights not read)."""
    import onnx

    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError / OSError variants
        raise MissingModelFile(
            f"{onnx_path}: cannot read the ONNX graph ({exc}); re-export the package", onnx_path
        ) from exc

    def io(v: Any) -> GraphIO:
        tt = v.type.tensor_type
        shape = tuple(d.dim_param if d.dim_param else d.dim_value for d in tt.shape.dim)
        return GraphIO(v.name, ONNX_DTYPES.get(tt.elem_type, f"onnx:{tt.elem_type}"), shape)

    inits = {i.name for i in model.graph.initializer}
    inputs = tuple(io(v) for v in model.graph.input if v.name not in inits)
    outputs = tuple(io(v) for v in model.graph.output)
    external: set[str] = set()
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            for kv in init.external_data:
                if kv.key == "location":
                    external.add(kv.value)
    return inputs, outputs, sorted(external)


def _eos_ids(cfg: dict[str, Any], gen_cfg: dict[str, Any], path: Path) -> tuple[int, ...]:
    """EOS is the union of every configured EOS id (genai_config and generation_config.json)."""
    ids: list[int] = []
    for raw in (cfg.get("model", {}).get("eos_token_id"), gen_cfg.get("eos_token_id")):
        if raw is None:
            continue
        for v in raw if isinstance(raw, list) else [raw]:
            if not isinstance(v, int) or isinstance(v, bool):
                raise InvalidConfig(
                    f"{path}: model.eos_token_id must be an int or a list of ints, got {raw!r}",
                    path,
                    "model.eos_token_id",
                )
            if v not in ids:
                ids.append(v)
    return tuple(ids)


def load_spec(path: str | Path) -> ModelSpec:
    """Read and validate the package at `path`.

    Raises PackageNotFound, InvalidConfig, MissingModelFile, MissingTokenizer or UnsupportedModel,
    each naming the path at fault and the fix.
    """
    root = Path(path).expanduser()
    if not root.is_dir():
        raise PackageNotFound(
            f"{root}: no such model folder; pass the folder that holds genai_config.json "
            "(or omit the path to use the default model)",
            root,
        )
    cfg_path = root / "genai_config.json"
    if not cfg_path.is_file():
        raise InvalidConfig(
            f"{cfg_path}: missing; this is not an ONNX Runtime GenAI package "
            "(convert a checkpoint with `onnxgen convert SRC OUT`)",
            cfg_path,
        )
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidConfig(
            f"{cfg_path}: not valid JSON ({exc}); fix or regenerate the file", cfg_path
        ) from exc
    if not isinstance(cfg, dict):
        raise InvalidConfig(f"{cfg_path}: must hold a JSON object", cfg_path)

    model_type = _get(cfg, "model.type", cfg_path, str)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"{cfg_path}: model.type {model_type!r} is not supported; supported decoder-only types: "
            + ", ".join(sorted(SUPPORTED_MODEL_TYPES)),
            cfg_path,
        )
    dec = "model.decoder"
    filename = _get(cfg, f"{dec}.filename", cfg_path, str)
    num_layers = _get(cfg, f"{dec}.num_hidden_layers", cfg_path, int)
    num_heads = _get(cfg, f"{dec}.num_attention_heads", cfg_path, int)
    num_kv_heads = _get(cfg, f"{dec}.num_key_value_heads", cfg_path, int, num_heads)
    head_size = _get(cfg, f"{dec}.head_size", cfg_path, int)
    hidden_size = _get(cfg, f"{dec}.hidden_size", cfg_path, int, num_heads * head_size)
    vocab_size = _get(cfg, "model.vocab_size", cfg_path, int)
    context_length = _get(cfg, "model.context_length", cfg_path, int)
    for key, val in (
        ("num_hidden_layers", num_layers),
        ("num_attention_heads", num_heads),
        ("num_key_value_heads", num_kv_heads),
        ("head_size", head_size),
    ):
        if val < 1:
            raise InvalidConfig(f"{cfg_path}: {dec}.{key} must be >= 1, got {val}", cfg_path, f"{dec}.{key}")
    if num_heads % num_kv_heads:
        raise InvalidConfig(
            f"{cfg_path}: num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})",
            cfg_path,
            f"{dec}.num_key_value_heads",
        )

    ins = _get(cfg, f"{dec}.inputs", cfg_path, dict, {})
    outs = _get(cfg, f"{dec}.outputs", cfg_path, dict, {})
    past_k = _layer_names(
        ins.get("past_key_names", "past_key_values.%d.key"),
        num_layers,
        f"{dec}.inputs.past_key_names",
        cfg_path,
    )
    past_v = _layer_names(
        ins.get("past_value_names", "past_key_values.%d.value"),
        num_layers,
        f"{dec}.inputs.past_value_names",
        cfg_path,
    )
    pres_k = _layer_names(
        outs.get("present_key_names", "present.%d.key"),
        num_layers,
        f"{dec}.outputs.present_key_names",
        cfg_path,
    )
    pres_v = _layer_names(
        outs.get("present_value_names", "present.%d.value"),
        num_layers,
        f"{dec}.outputs.present_value_names",
        cfg_path,
    )

    onnx_path = root / filename
    if not onnx_path.is_file():
        raise MissingModelFile(
            f"{onnx_path}: the decoder graph named by model.decoder.filename is missing; "
            "copy it into the package or fix the filename",
            onnx_path,
        )
    inputs, outputs, external = _read_graph_io(onnx_path)
    for name in external:
        if not (onnx_path.parent / name).is_file():
            raise MissingModelFile(
                f"{onnx_path.parent / name}: external weight file referenced by {onnx_path.name} is missing; "
                "copy it next to the graph",
                onnx_path.parent / name,
            )
    in_names = {i.name: i for i in inputs}
    out_names = {o.name for o in outputs}
    input_ids = ins.get("input_ids", "input_ids")
    embeds = ins.get("inputs_embeds", "inputs_embeds") if "inputs_embeds" in ins else None
    multimodal = read_multimodal(cfg, root, cfg_path)
    if multimodal is not None and embeds not in in_names:
        raise InvalidConfig(
            f"{cfg_path}: a vision pipeline's decoder takes model.decoder.inputs.inputs_embeds, which the graph lacks",
            cfg_path,
            f"{dec}.inputs.inputs_embeds",
        )
    if input_ids not in in_names and multimodal is None:
        raise InvalidConfig(
            f"{cfg_path}: the graph has no input {input_ids!r} (model.decoder.inputs.input_ids)",
            cfg_path,
            f"{dec}.inputs.input_ids",
        )
    logits = outs.get("logits", "logits")
    if logits not in out_names:
        raise InvalidConfig(
            f"{cfg_path}: the graph has no output {logits!r} (model.decoder.outputs.logits)",
            cfg_path,
            f"{dec}.outputs.logits",
        )
    for kind, names, have in (
        ("inputs.past_key_names", past_k, in_names),
        ("inputs.past_value_names", past_v, in_names),
        ("outputs.present_key_names", pres_k, out_names),
        ("outputs.present_value_names", pres_v, out_names),
    ):
        missing = [n for n in names if n not in have]
        if missing:
            raise InvalidConfig(
                f"{cfg_path}: the graph lacks {missing[0]!r} named by model.decoder.{kind}; "
                "fix the name pattern or num_hidden_layers",
                cfg_path,
                f"{dec}.{kind}",
            )
    mask = ins.get("attention_mask", "attention_mask")
    pos = ins.get("position_ids", "position_ids")
    kv_dtype = in_names[past_k[0]].dtype

    tok_path = root / "tokenizer.json"
    if not tok_path.is_file():
        raise MissingTokenizer(
            f"{tok_path}: missing; copy the model's tokenizer.json into the package", tok_path
        )
    tok_cfg: dict[str, Any] = {}
    tok_cfg_path = root / "tokenizer_config.json"
    if tok_cfg_path.is_file():
        try:
            tok_cfg = json.loads(tok_cfg_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise MissingTokenizer(
                f"{tok_cfg_path}: not valid JSON ({exc}); fix or remove it", tok_cfg_path
            ) from exc
    template_path = root / "chat_template.jinja"
    chat_template = template_path.read_text(encoding="utf-8") if template_path.is_file() else None
    if chat_template is None and isinstance(tok_cfg.get("chat_template"), str):
        chat_template = tok_cfg["chat_template"]

    gen_cfg: dict[str, Any] = {}
    if (root / "generation_config.json").is_file():
        try:
            gen_cfg = json.loads((root / "generation_config.json").read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            gen_cfg = {}

    s = cfg.get("search", {}) if isinstance(cfg.get("search"), dict) else {}
    search = SearchDefaults(
        do_sample=bool(s.get("do_sample", False)),
        temperature=float(s.get("temperature", 1.0)),
        top_k=int(s.get("top_k", 50)),
        top_p=float(s.get("top_p", 1.0)),
        repetition_penalty=float(s.get("repetition_penalty", 1.0)),
        max_length=int(s["max_length"]) if isinstance(s.get("max_length"), int) else None,
        past_present_share_buffer=bool(s.get("past_present_share_buffer", False)),
    )
    chunk = _get(cfg, "model.runtime_configurable.chunked_prefill.chunk_size", cfg_path, int, None)
    if chunk is None:
        chunk = _get(cfg, "search.chunk_size", cfg_path, int, None)
    if chunk is not None and chunk < 1:
        raise InvalidConfig(
            f"{cfg_path}: chunk_size must be >= 1, got {chunk}", cfg_path, "search.chunk_size"
        )

    def opt_int(key: str) -> int | None:
        v = cfg["model"].get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    return ModelSpec(
        path=root,
        model_type=model_type,
        decoder_path=onnx_path,
        inputs=inputs,
        outputs=outputs,
        input_ids_name=input_ids,
        attention_mask_name=mask if mask in in_names else None,
        position_ids_name=pos if pos in in_names else None,
        logits_name=logits,
        past_key_names=past_k,
        past_value_names=past_v,
        present_key_names=pres_k,
        present_value_names=pres_v,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        context_length=context_length,
        kv_dtype=kv_dtype,
        bos_token_id=opt_int("bos_token_id"),
        eos_token_ids=_eos_ids(cfg, gen_cfg, cfg_path),
        pad_token_id=opt_int("pad_token_id"),
        search=search,
        chunk_size=chunk,
        tokenizer_path=tok_path,
        tokenizer_config=tok_cfg,
        chat_template=chat_template,
        config=cfg,
        inputs_embeds_name=embeds if embeds in in_names else None,
        multimodal=multimodal,
    )
