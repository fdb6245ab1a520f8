"""Writing a synthetic package folder: tokenizer files, `model.onnx` + `model.onnx.data`, and
`genai_config.json` as onnxruntime-genai's model builder writes it."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from onnxgen.convert.synthetic.blocks import Builder
from onnxgen.convert.synthetic.config import SyntheticConfig
from onnxgen.convert.synthetic.external_data import stream_initializers
from onnxgen.convert.synthetic.gqa import build_gqa
from onnxgen.convert.synthetic.plain import build_plain
from onnxgen.convert.synthetic.tokenizer import byte_level_tokenizer, tokenizer_from_dir
from onnxgen.convert.synthetic.weights import WeightSource
from onnxgen.errors import ConversionError


def write_package(
    out_dir: str | os.PathLike[str],
    cfg: SyntheticConfig,
    weights: Mapping[str, Any] | None = None,
    *,
    seed: int = 0,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    progress: bool = False,
) -> Path:
    """Write a package for `cfg` into `out_dir` (created; existing package files are overwritten).

    `weights`: HF Llama names (see `hf_weight_shapes`), numpy arrays or torch tensors of any float
    dtype, cast to cfg.dtype. None: random weights, generated one tensor at a time and streamed
    into model.onnx.data (never the whole model in memory). Up to 2**27 parameters they equal
    `random_weights(cfg, seed)` exactly; larger models use torch's generator (CUDA when available,
    else CPU; same distributions, other values; `reference_weights(cfg, None, seed)` on the same
    host reproduces them); peak memory stays a few tensors, not the model. `tokenizer_dir`: copy
    tokenizer.json / tokenizer_config.json / chat_template.jinja / special_tokens_map.json from there
    (cfg.vocab_size must be >= its size) instead of building the tiny byte-level BPE. `progress`: a
    status line on stdout while the weights are written. Returns the package path.
    Raises ConversionError for missing/mis-shaped weights or a too-small vocab.
    """
    import onnx

    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    # Tokenizer first (cheap, validates the vocab size).
    if tokenizer_dir is not None:
        tok = tokenizer_from_dir(Path(tokenizer_dir).expanduser())
    else:
        tok = byte_level_tokenizer(cfg)
    bos, eos, pad, tok_size = tok.token_ids()
    if tok_size > cfg.vocab_size:
        raise ConversionError(
            f"the tokenizer has {tok_size} tokens but vocab_size is {cfg.vocab_size}; raise vocab_size"
        )
    if cfg.eos_token_ids:
        eos = list(cfg.eos_token_ids)
    tok.write(out)

    b = Builder(cfg, WeightSource(cfg, weights, seed))
    (build_gqa if cfg.attention == "gqa" else build_plain)(b)
    model = b.model_proto()
    workers = max(1, min(8, os.cpu_count() or 1))
    model.graph.initializer.extend(stream_initializers(b.g.inits, out / "model.onnx.data", progress, workers))
    onnx.save_model(model, str(out / "model.onnx"))
    (out / "genai_config.json").write_text(
        json.dumps(genai_config(cfg, bos, eos, pad), indent=4), encoding="utf-8"
    )
    return out


def genai_config(cfg: SyntheticConfig, bos: int | None, eos: list[int], pad: int | None) -> dict[str, Any]:
    """The genai_config.json dict for `cfg`: the decoder's I/O names and shape, the special token ids
    (a single eos as an int), sliding window and chunked prefill when set, greedy search defaults."""
    inputs = {"input_ids": "input_ids", "attention_mask": "attention_mask"}
    if cfg.attention != "gqa":
        inputs["position_ids"] = "position_ids"
    inputs |= {"past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
    model: dict[str, Any] = {
        "bos_token_id": bos,
        "context_length": cfg.context_length,
        "decoder": {
            "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
            "filename": "model.onnx",
            "head_size": cfg.head_dim,
            "hidden_size": cfg.hidden_size,
            "inputs": inputs,
            "outputs": {
                "logits": "logits",
                "present_key_names": "present.%d.key",
                "present_value_names": "present.%d.value",
            },
            "num_attention_heads": cfg.num_heads,
            "num_hidden_layers": cfg.num_layers,
            "num_key_value_heads": cfg.num_kv_heads,
        },
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": pad,
        "type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
    }
    if cfg.attention == "gqa" and cfg.local_window_size > 0:
        model["decoder"]["sliding_window"] = {
            "window_size": cfg.local_window_size,
            "slide_key_value_cache": False,
        }
    if cfg.chunk_size is not None:
        model["runtime_configurable"] = {"chunked_prefill": {"chunk_size": cfg.chunk_size}}
    search = {
        "diversity_penalty": 0.0,
        "do_sample": False,
        "early_stopping": True,
        "length_penalty": 1.0,
        "max_length": cfg.context_length,
        "min_length": 0,
        "no_repeat_ngram_size": 0,
        "num_beams": 1,
        "num_return_sequences": 1,
        "past_present_share_buffer": cfg.attention == "gqa",
        "repetition_penalty": 1.0,
        "temperature": 1.0,
        "top_k": 50,
        "top_p": 1.0,
    }
    return {"model": model, "search": search}
