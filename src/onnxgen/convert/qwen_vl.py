"""A Qwen2.5-VL package from a seeded random transformers checkpoint: the tests' (and GPU benchmarks')
vision-language model.

    hf = random_qwen_vl_checkpoint(tmp / "hf", VLShape())        # transformers' Qwen2_5_VLForConditionalGeneration
    pkg = qwen_vl_package(hf, tmp / "pkg", cache_dir=tmp / "c")  # builder text decoder + vision + embedding graphs

The text decoder is onnxruntime-genai's model builder's (`exclude_embeds`: it takes `inputs_embeds` and 3-row
MRoPE `position_ids`, `com.microsoft::MRotaryEmbedding`); the vision encoder and the embedding graph are
written from the checkpoint's weights (`convert/vision_graph.py`); `genai_config.json` gets the `vision` and
`embedding` sections and the image token ids, and `processor_config.json` the image transforms, in
onnxruntime-genai's layout. The tokenizer is the built-in byte-level BPE with Qwen's vision tokens and
Qwen2-VL's chat template (content parts of type image / image_url render as one image placeholder).

Needs the `convert` extra (torch, transformers, onnxruntime-genai).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# The byte-level tokenizer's specials come first: <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2, then these.
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 3, 4, 5, 6
EOS = 2

# Qwen2-VL's chat template (images and videos as placeholders framed by vision start / end tokens)
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class VLShape:
    """A Qwen2.5-VL checkpoint's shape. Defaults: a tiny CPU fixture (two text layers of 64, a two-block
    vision tower of 32 whose second block attends over the whole image and the first within windows of
    2 x 2 merged patches, Qwen's patch 14 and 2 x 2 merge)."""

    vocab_size: int = 384
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    mrope_section: tuple[int, ...] = (2, 3, 3)
    context_length: int = 4096
    rope_theta: float = 10000.0
    vision_depth: int = 2
    vision_hidden: int = 32
    vision_heads: int = 2
    vision_intermediate: int = 64
    patch_size: int = 14
    merge_size: int = 2
    window_size: int = 56
    fullatt_blocks: tuple[int, ...] = (1,)
    init_std: float = 0.06
    min_pixels: int = 56 * 56
    max_pixels: int = 448 * 448
    extra: dict[str, Any] = field(default_factory=dict)


def random_qwen_vl_checkpoint(dest: Path, shape: VLShape, *, seed: int = 0, dtype: str = "float32") -> Path:
    """Save a seeded random `Qwen2_5_VLForConditionalGeneration` of `shape` (norm weights drawn around 1, so
    a dropped or misplaced norm shows) and its tokenizer files into `dest`; returns `dest`. Raises ValueError
    for a shape with a projection of `vocab_size` outputs besides the lm_head (the builder would take it for
    the lm_head: it picks any Linear of that width)."""
    hd = shape.hidden_size // shape.num_heads
    v, m2 = shape.vision_hidden, shape.merge_size**2
    widths = {shape.hidden_size, shape.intermediate_size, shape.num_kv_heads * hd}
    widths |= {v, 3 * v, shape.vision_intermediate, v * m2}
    if shape.vocab_size in widths:
        raise ValueError(f"vocab_size {shape.vocab_size} equals a projection's width in {sorted(widths)}")
    import torch
    import transformers

    from onnxgen.convert.synthetic.config import SyntheticConfig
    from onnxgen.convert.synthetic.tokenizer import byte_level_tokenizer

    dest = Path(dest)
    cfg = transformers.Qwen2_5_VLConfig(
        text_config={
            "vocab_size": shape.vocab_size,
            "hidden_size": shape.hidden_size,
            "intermediate_size": shape.intermediate_size,
            "num_hidden_layers": shape.num_layers,
            "num_attention_heads": shape.num_heads,
            "num_key_value_heads": shape.num_kv_heads,
            "max_position_embeddings": shape.context_length,
            "rms_norm_eps": 1e-6,
            "initializer_range": shape.init_std,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": shape.rope_theta,
                "mrope_section": list(shape.mrope_section),
            },
            "bos_token_id": None,
            "eos_token_id": EOS,
            "pad_token_id": EOS,
        },
        vision_config={
            "depth": shape.vision_depth,
            "hidden_size": shape.vision_hidden,
            "intermediate_size": shape.vision_intermediate,
            "num_heads": shape.vision_heads,
            "out_hidden_size": shape.hidden_size,
            "patch_size": shape.patch_size,
            "spatial_merge_size": shape.merge_size,
            "temporal_patch_size": 2,
            "window_size": shape.window_size,
            "fullatt_block_indexes": list(shape.fullatt_blocks),
            "tokens_per_second": 2,
            "initializer_range": shape.init_std,
        },
        image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=False,
        **shape.extra,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("norm" in name or "ln_q" in name) and p.dim() == 1:
                p.uniform_(0.5, 1.5)
    model.to(getattr(torch, dtype)).save_pretrained(dest)
    tok = byte_level_tokenizer(
        SyntheticConfig(vocab_size=shape.vocab_size, context_length=shape.context_length),
        extra_special=VISION_TOKENS,
        chat_template=CHAT_TEMPLATE,
    )
    tok.write(dest)
    return dest


def processor_config(shape: VLShape) -> dict[str, Any]:
    """`processor_config.json` of a package of `shape` (onnxruntime-extensions' transforms, Qwen2.5-VL's)."""

    def op(kind: str, name: str, **attrs: Any) -> dict[str, Any]:
        return {"operation": {"name": name, "type": kind, **({"attrs": attrs} if attrs else {})}}

    return {
        "processor": {
            "name": "qwen2_5_image_processor",
            "transforms": [
                op("DecodeImage", "decode_image", color_space="RGB"),
                op("ConvertRGB", "convert_to_rgb"),
                op(
                    "Resize",
                    "resize",
                    width=540,
                    height=360,
                    smart_resize=1,
                    min_pixels=shape.min_pixels,
                    max_pixels=shape.max_pixels,
                    patch_size=shape.patch_size,
                    merge_size=shape.merge_size,
                ),
                op("Rescale", "rescale", rescale_factor=1 / 255),
                op("Normalize", "normalize", mean=list(MEAN), std=list(STD), qwen2_5_vl=1),
                op(
                    "PatchImage",
                    "patch_image",
                    patch_size=shape.patch_size,
                    temporal_patch_size=2,
                    merge_size=shape.merge_size,
                ),
            ],
        }
    }


def qwen_vl_package(hf_dir: Path, out: Path, *, cache_dir: Path, shape: VLShape | None = None) -> Path:
    """Build the package of the checkpoint `hf_dir` (fp32, CPU) into `out` in this process: the builder's text
    decoder, the vision and embedding graphs, `processor_config.json`, and `genai_config.json`'s multimodal
    sections. Returns `out`."""
    import onnx
    from safetensors.numpy import load_file

    from onnxgen.convert.builder_run import build
    from onnxgen.convert.vision_graph import embedding_graph, vision_graph

    shape = shape or VLShape()
    hf_dir, out = Path(hf_dir), Path(out)
    build(
        hf_dir,
        out,
        precision="fp32",
        execution_provider="cpu",
        cache_dir=Path(cache_dir),
        extra_options={"exclude_embeds": "true"},
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(hf_dir / name, out / name)
    hf_cfg = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    weights: dict[str, Any] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    vcfg = hf_cfg["vision_config"]
    # NOTE: transformers 5 saves Qwen2.5-VL under the original names (`visual.*`, `model.embed_tokens`)
    prefix = "model.visual." if any(k.startswith("model.visual.") for k in weights) else "visual."
    # weights beside each graph (`NAME.onnx.data`): a 2B-class vision tower is past protobuf's 2 GB in fp32
    external = {"save_as_external_data": True, "all_tensors_to_one_file": True, "size_threshold": 1024}
    onnx.save(
        vision_graph(weights, vcfg, prefix), str(out / "vision.onnx"), location="vision.onnx.data", **external
    )
    embed = next(k for k in weights if k.endswith("embed_tokens.weight"))
    table = weights[embed].astype("float32")
    onnx.save(
        embedding_graph(table, int(hf_cfg["image_token_id"])),
        str(out / "embedding.onnx"),
        location="embedding.onnx.data",
        **external,
    )
    (out / "processor_config.json").write_text(
        json.dumps(processor_config(shape), indent=2), encoding="utf-8"
    )
    gc = json.loads((out / "genai_config.json").read_text(encoding="utf-8"))
    m = gc["model"]
    m.update(
        type="qwen2_5_vl",
        image_token_id=hf_cfg["image_token_id"],
        video_token_id=hf_cfg["video_token_id"],
        vision_start_token_id=hf_cfg["vision_start_token_id"],  # (onnxruntime-genai 0.18 refuses an end id)
        embedding={
            "filename": "embedding.onnx",
            "inputs": {"input_ids": "input_ids", "image_features": "image_features"},
            "outputs": {"inputs_embeds": "inputs_embeds"},
        },
        vision={
            "filename": "vision.onnx",
            "config_filename": "processor_config.json",
            "spatial_merge_size": vcfg["spatial_merge_size"],
            "patch_size": vcfg["patch_size"],
            "window_size": vcfg["window_size"],
            "tokens_per_second": float(vcfg["tokens_per_second"]),
            "inputs": {"pixel_values": "pixel_values", "image_grid_thw": "image_grid_thw"},
            "outputs": {"image_features": "image_features"},
        },
    )
    (out / "genai_config.json").write_text(json.dumps(gc, indent=4), encoding="utf-8")
    return out
