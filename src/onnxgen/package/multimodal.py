"""The multimodal parts of an ONNX Runtime GenAI package: `model.vision`, `model.embedding` (and the
`model.speech` section, refused by name) of `genai_config.json`, and the image processor of
`processor_config.json`, read into a frozen `MultimodalSpec`.

A Qwen2.5-VL package (`model.type` "qwen2_5_vl") is a pipeline of three graphs:

    vision     pixel_values [patches, C*T*P*P], image_grid_thw [1, 3]  ->  image_features [tokens, hidden]
    embedding  input_ids [1, S], image_features [k, hidden]            ->  inputs_embeds [1, S, hidden]
    decoder    inputs_embeds, attention_mask, position_ids [3, 1, S] (MRoPE), past KV -> logits, present KV

`processor_config.json` names the image transforms (onnxruntime-extensions' format): decode, RGB, a
"smart" resize to multiples of patch_size * merge_size within [min_pixels, max_pixels], rescale, normalise,
patchify. Reading a package never runs anything; unsupported sections and transforms are `UnsupportedModel`
errors that name them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onnxgen.errors import InvalidConfig, MissingModelFile, UnsupportedModel

# model.type -> the image pipeline it runs (only Qwen2.5-VL's, for now)
VISION_TYPES = frozenset({"qwen2_5_vl"})
# sections of `model` that name a graph onnxgen does not run yet
UNSUPPORTED_SECTIONS = ("speech",)
# the transforms of a Qwen2.5-VL processor_config.json, in order (`Resize` .. `PatchImage` are read)
_KNOWN_TRANSFORMS = ("DecodeImage", "ConvertRGB", "Resize", "Rescale", "Normalize", "PatchImage")


@dataclass(frozen=True)
class VisionSpec:
    """`model.vision`: the vision encoder graph, its I/O names and geometry."""

    path: Path
    pixel_values: str
    image_grid_thw: str
    image_features: str
    patch_size: int
    spatial_merge_size: int
    window_size: int
    tokens_per_second: float


@dataclass(frozen=True)
class EmbeddingSpec:
    """`model.embedding`: the graph that embeds token ids and puts image features at the image tokens."""

    path: Path
    input_ids: str
    image_features: str
    inputs_embeds: str


@dataclass(frozen=True)
class ProcessorSpec:
    """The image processor of `processor_config.json` (Qwen2.5-VL's): resize to multiples of
    `patch_size * merge_size` with a pixel count in `[min_pixels, max_pixels]`, `pixel * rescale_factor`,
    `(x - mean) / std` per channel, patches of `temporal_patch_size` frames of `patch_size`^2 pixels."""

    min_pixels: int
    max_pixels: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    rescale_factor: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    @property
    def factor(self) -> int:
        """Image sides are resized to multiples of this."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Values per row of `pixel_values`: channels x frames x patch_size^2."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size


@dataclass(frozen=True)
class MultimodalSpec:
    """A package's image pipeline. `image_token_id`: the placeholder token one image expands to (one per
    feature row); `vision_start_token_id` / `vision_end_token_id` frame it in the prompt. `mrope`: the decoder
    takes 3-row (temporal, height, width) position ids."""

    kind: str
    vision: VisionSpec
    embedding: EmbeddingSpec
    processor: ProcessorSpec
    image_token_id: int
    vision_start_token_id: int | None
    vision_end_token_id: int | None
    mrope: bool


def _section(cfg: dict[str, Any], key: str, cfg_path: Path) -> dict[str, Any] | None:
    node = cfg.get("model", {}).get(key)
    if node is None:
        return None
    if not isinstance(node, dict):
        raise InvalidConfig(f"{cfg_path}: model.{key} must be an object", cfg_path, f"model.{key}")
    return node


def _str(node: dict[str, Any], key: str, default: str, where: str, cfg_path: Path) -> str:
    v = node.get(key, default)
    if not isinstance(v, str) or not v:
        raise InvalidConfig(
            f"{cfg_path}: {where}.{key} must be a name, got {v!r}", cfg_path, f"{where}.{key}"
        )
    return v


def _int(node: dict[str, Any], key: str, default: int | None, where: str, cfg_path: Path) -> int:
    v = node.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise InvalidConfig(
            f"{cfg_path}: {where}.{key} must be an int >= 1, got {v!r}", cfg_path, f"{where}.{key}"
        )
    return v


def _graph_file(root: Path, node: dict[str, Any], where: str, cfg_path: Path) -> Path:
    path = root / _str(node, "filename", "", where, cfg_path)
    if not path.is_file():
        raise MissingModelFile(
            f"{path}: the graph named by {where}.filename is missing; copy it into the package", path
        )
    return path


def read_multimodal(cfg: dict[str, Any], root: Path, cfg_path: Path) -> MultimodalSpec | None:
    """The package's `MultimodalSpec` (None: a text-only package). Raises `UnsupportedModel` naming a section
    onnxgen cannot run (`model.speech`, a vision pipeline of another model type, an unknown image transform),
    `InvalidConfig` / `MissingModelFile` naming the key or file at fault."""
    model_type = cfg.get("model", {}).get("type")
    for key in UNSUPPORTED_SECTIONS:
        if _section(cfg, key, cfg_path) is not None:
            raise UnsupportedModel(
                f"{cfg_path}: the package has a model.{key} section ({key} input); onnxgen runs no {key} "
                "graphs yet (supported attachments: images of Qwen2.5-VL packages)",
                cfg_path,
            )
    vision = _section(cfg, "vision", cfg_path)
    embedding = _section(cfg, "embedding", cfg_path)
    if vision is None and embedding is None:
        return None
    if model_type not in VISION_TYPES:
        raise UnsupportedModel(
            f"{cfg_path}: model.vision of model.type {model_type!r} is not supported; onnxgen runs the image "
            f"pipeline of: {', '.join(sorted(VISION_TYPES))}",
            cfg_path,
        )
    if vision is None or embedding is None:
        missing = "model.vision" if vision is None else "model.embedding"
        raise InvalidConfig(f"{cfg_path}: {model_type} needs {missing}", cfg_path, missing)
    vin, vout = vision.get("inputs", {}), vision.get("outputs", {})
    ein, eout = embedding.get("inputs", {}), embedding.get("outputs", {})
    v = VisionSpec(
        path=_graph_file(root, vision, "model.vision", cfg_path),
        pixel_values=_str(vin, "pixel_values", "pixel_values", "model.vision.inputs", cfg_path),
        image_grid_thw=_str(vin, "image_grid_thw", "image_grid_thw", "model.vision.inputs", cfg_path),
        image_features=_str(vout, "image_features", "image_features", "model.vision.outputs", cfg_path),
        patch_size=_int(vision, "patch_size", 14, "model.vision", cfg_path),
        spatial_merge_size=_int(vision, "spatial_merge_size", 2, "model.vision", cfg_path),
        window_size=_int(vision, "window_size", 112, "model.vision", cfg_path),
        tokens_per_second=float(vision.get("tokens_per_second", 2.0)),
    )
    e = EmbeddingSpec(
        path=_graph_file(root, embedding, "model.embedding", cfg_path),
        input_ids=_str(ein, "input_ids", "input_ids", "model.embedding.inputs", cfg_path),
        image_features=_str(ein, "image_features", "image_features", "model.embedding.inputs", cfg_path),
        inputs_embeds=_str(eout, "inputs_embeds", "inputs_embeds", "model.embedding.outputs", cfg_path),
    )
    proc_name = _str(vision, "config_filename", "processor_config.json", "model.vision", cfg_path)
    proc = read_processor(root / proc_name)
    if proc.patch_size != v.patch_size or proc.merge_size != v.spatial_merge_size:
        raise InvalidConfig(
            f"{root / proc_name}: patch_size {proc.patch_size} / merge_size {proc.merge_size} differ from "
            f"model.vision's {v.patch_size} / {v.spatial_merge_size}",
            cfg_path,
            "model.vision.patch_size",
        )
    m = cfg["model"]
    image_token = m.get("image_token_id")
    if not isinstance(image_token, int) or isinstance(image_token, bool):
        raise InvalidConfig(
            f"{cfg_path}: model.image_token_id must be the id images expand to",
            cfg_path,
            "model.image_token_id",
        )

    def opt(key: str) -> int | None:
        x = m.get(key)
        return x if isinstance(x, int) and not isinstance(x, bool) else None

    return MultimodalSpec(
        kind=str(model_type),
        vision=v,
        embedding=e,
        processor=proc,
        image_token_id=image_token,
        vision_start_token_id=opt("vision_start_token_id"),
        vision_end_token_id=opt("vision_end_token_id"),
        mrope=True,
    )


def read_processor(path: Path) -> ProcessorSpec:
    """Read `processor_config.json` (onnxruntime-extensions' transform list). Raises `MissingModelFile`,
    `InvalidConfig`, or `UnsupportedModel` naming a transform onnxgen does not apply."""
    if not path.is_file():
        raise MissingModelFile(f"{path}: missing; the vision part needs its image processor config", path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        transforms = doc["processor"]["transforms"]
        ops = {t["operation"]["type"]: t["operation"].get("attrs", {}) for t in transforms}
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise InvalidConfig(f"{path}: not a processor config ({exc!r})", path) from exc
    unknown = [k for k in ops if k not in _KNOWN_TRANSFORMS]
    if unknown:
        raise UnsupportedModel(
            f"{path}: image transform {unknown[0]!r} is not supported; onnxgen applies: "
            + ", ".join(_KNOWN_TRANSFORMS),
            path,
        )
    for need in ("Resize", "Normalize", "PatchImage"):
        if need not in ops:
            raise InvalidConfig(f"{path}: the transforms lack {need}", path, need)
    resize, norm, patch = ops["Resize"], ops["Normalize"], ops["PatchImage"]
    if not resize.get("smart_resize", 0):
        raise UnsupportedModel(f"{path}: only Resize with smart_resize (Qwen2.5-VL's) is supported", path)

    def num(node: dict[str, Any], key: str, default: Any) -> Any:
        x = node.get(key, default)
        if not isinstance(x, int | float) or isinstance(x, bool) or x <= 0:
            raise InvalidConfig(f"{path}: {key} must be a positive number, got {x!r}", path, key)
        return x

    def triple(key: str) -> tuple[float, float, float]:
        x = norm.get(key)
        if not (isinstance(x, list) and len(x) == 3 and all(isinstance(a, int | float) for a in x)):
            raise InvalidConfig(f"{path}: Normalize.{key} must be three numbers, got {x!r}", path, key)
        return (float(x[0]), float(x[1]), float(x[2]))

    return ProcessorSpec(
        min_pixels=int(num(resize, "min_pixels", 56 * 56)),
        max_pixels=int(num(resize, "max_pixels", 28 * 28 * 1280)),
        patch_size=int(num(patch, "patch_size", 14)),
        merge_size=int(num(patch, "merge_size", 2)),
        temporal_patch_size=int(num(patch, "temporal_patch_size", 2)),
        rescale_factor=float(num(ops.get("Rescale", {}), "rescale_factor", 1 / 255)),
        mean=triple("mean"),
        std=triple("std"),
    )
