"""Run onnxruntime-genai's model builder in this process, with the patches its known bugs need.

    python -m onnxgen.convert.builder_run -i HF_DIR -o OUT -p fp32 -e cpu -c CACHE [--extra_options K=V ...]

takes the builder's own arguments (`convert/checkpoint.py` runs it as a subprocess: its output is the
builder's). `build(hf_dir, out, ...)` does the same in the calling process (the tiny-checkpoint zoo builds
many packages in one process, paying the builder's imports once). Both apply `patch_builder()` first.

Patches (each only where the class has the shape it was written for; otherwise the builder runs as is):

- Gemma 3's RoPE per layer type (transformers 5): the loaded config gets the form the builder reads
  (`builder_config.flat_layer_type_rope`); a flat form in config.json would not survive loading.
- LongRoPE (Phi-3.5, Phi-4-mini) saved by transformers 5: `rope_parameters` has `rope_type` but not the
  legacy `type` that the builder's Phi-3 LongRoPE class reads (`KeyError: 'type'`); the loaded config
  gets both.
- OLMo (builder 0.18): its class keeps the base class's RMSNorm (`SimplifiedLayerNormalization`), where
  OLMo's layer norm subtracts the mean (`LayerNormalization`, no weight or bias); the patch makes it so.
- SmolLM3's no-RoPE layers (builder 0.18): `SmolLM3Model.make_attention` turns off only RoPE *fused in
  attention* for those layers, so the base class then asks for a separate RotaryEmbedding over
  `position_ids`, an input it already removed (`KeyError: 'position_ids'`). The patch turns RoPE off in
  those layers altogether, as transformers does.

This module imports the builder (torch, transformers) only inside its functions.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_PATCHED = False


def patch_builder() -> list[str]:
    """Apply the patches (once per process); return the names of those applied."""
    global _PATCHED
    import onnxruntime_genai.models  # noqa: F401  (puts the builder's folder on sys.path)

    applied: list[str] = []
    if _PATCHED:
        return applied
    _PATCHED = True
    # NOTE: builder.py imports its classes as top-level `builders.*` modules (its folder is on sys.path);
    # the classes it dispatches to are those, not `onnxruntime_genai.models.builders.*`.
    try:
        from builders.llama import LlamaModel
        from builders.olmo import OLMoModel
        from builders.smollm import SmolLM3Model
    except ImportError:  # pragma: no cover - another builder layout
        return applied
    from onnxruntime_genai.models import builder as B  # what build() and main() run

    if callable(getattr(B, "get_hf_details", None)):
        B.get_hf_details = _flat_rope_details(B.get_hf_details)
        applied.append("RoPE settings of transformers 5 (per layer type; LongRoPE's type)")
    if SmolLM3Model.__dict__.get("make_attention") is not None:
        SmolLM3Model.make_attention = _smollm3_make_attention(LlamaModel.make_attention)
        applied.append("SmolLM3 no-RoPE layers")
    if "__init__" in OLMoModel.__dict__ and "layernorm_attrs" not in OLMoModel.__dict__:
        OLMoModel.__init__ = _olmo_init(OLMoModel.__init__)
        applied.append("OLMo layer norm")
    return applied


def _olmo_init(base: Any) -> Any:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        base(self, *args, **kwargs)
        self.layernorm_attrs["simple"] = False  # LayerNormalization: OLMo's norm subtracts the mean

    return __init__


def _flat_rope_details(base: Any) -> Any:
    from onnxgen.convert.builder_config import flat_layer_type_rope

    def get_hf_details(*args: Any, **kwargs: Any) -> Any:
        details = base(*args, **kwargs)
        cfg = details["hf_config"]
        for c in (cfg, getattr(cfg, "text_config", None)):
            rp = getattr(c, "rope_parameters", None) if c is not None else None
            flat = flat_layer_type_rope(rp)
            if flat is not None:
                c.rope_parameters, c.rope_local_base_freq = flat
            elif isinstance(rp, dict) and rp.get("rope_type") == "longrope" and "type" not in rp:
                c.rope_parameters = {**rp, "type": "longrope"}  # the Phi-3 LongRoPE class reads "type"
        return details

    return get_hf_details


def _smollm3_make_attention(base: Any) -> Any:
    def make_attention(self: Any, layer_id: int, attention: Any, root_input: str, **kwargs: Any) -> Any:
        attrs = self.attention_attrs
        saved = (attrs["rope"], attrs["use_rope_in_attn"], self.window_size)
        if not self.no_rope_layers[layer_id]:  # transformers: no_rope_layers[i] == 0 -> no RoPE in layer i
            attrs["rope"] = attrs["use_rope_in_attn"] = False
        if self.layer_types[layer_id] == "full_attention":
            self.window_size = -1
        try:
            return base(self, layer_id, attention, root_input, **kwargs)
        finally:
            attrs["rope"], attrs["use_rope_in_attn"], self.window_size = saved

    return make_attention


def build(
    hf_dir: Path,
    out: Path,
    *,
    precision: str = "fp32",
    execution_provider: str = "cpu",
    cache_dir: Path,
    extra_options: Mapping[str, object] | None = None,
    quiet: bool = True,
) -> Path:
    """Run the builder on `hf_dir` (a folder the builder reads as it is: see `builder_config.builder_source`)
    into `out`, in this process. Its output is swallowed when `quiet`. Raises whatever the builder raises."""
    patch_builder()
    from onnxruntime_genai.models import builder as B

    opts = [f"{k}={v}" for k, v in (extra_options or {}).items()]
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink) if quiet else contextlib.nullcontext():
        kw = B.parse_extra_options(
            None, str(hf_dir), str(out), precision, execution_provider, str(cache_dir), opts
        )
        B.create_model(None, str(hf_dir), str(out), precision, execution_provider, str(cache_dir), **kw)
    return out


def main(argv: list[str]) -> int:
    """The builder's command line, with the patches applied."""
    applied = patch_builder()
    for name in applied:
        print(f"onnxgen: patched the model builder: {name}", flush=True)
    from onnxruntime_genai.models import builder as B

    sys.argv = ["builder", *argv]
    args = B.get_args()
    kw = B.parse_extra_options(
        args.model_name,
        args.input,
        args.output,
        args.precision,
        args.execution_provider,
        args.cache_dir,
        args.extra_options,
        builder_config_version=args.builder_config_version,
        target_options=args.target_options,
        drafter_options=args.drafter_options,
        speculative_options=args.speculative_options,
        runtime_config=args.runtime_config,
        search=args.search,
    )
    B.create_model(
        args.model_name,
        args.input,
        args.output,
        args.precision,
        args.execution_provider,
        args.cache_dir,
        **kw,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
