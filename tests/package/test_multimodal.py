"""Multimodal packages: the vision / embedding sections of genai_config.json and processor_config.json read into
a `MultimodalSpec`, every section and transform onnxgen cannot run refused by name; image keys in token ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from onnxgen.errors import InvalidConfig, MissingModelFile, UnsupportedModel
from onnxgen.package import load_spec
from onnxgen.package.attachments import KEY_BASE, ImageInput, image_key, key_images, split_key, unkey


def test_qwen_vl_package_spec(qwen_vl_dir):
    spec = load_spec(qwen_vl_dir)
    mm = spec.multimodal
    assert mm is not None and mm.kind == "qwen2_5_vl" and mm.mrope
    assert (mm.image_token_id, mm.vision_start_token_id) == (5, 3)
    assert (
        mm.vision.path == qwen_vl_dir / "vision.onnx" and mm.embedding.path == qwen_vl_dir / "embedding.onnx"
    )
    assert (mm.vision.pixel_values, mm.vision.image_grid_thw, mm.vision.image_features) == (
        "pixel_values",
        "image_grid_thw",
        "image_features",
    )
    assert (mm.embedding.input_ids, mm.embedding.image_features, mm.embedding.inputs_embeds) == (
        "input_ids",
        "image_features",
        "inputs_embeds",
    )
    assert (mm.vision.patch_size, mm.vision.spatial_merge_size, mm.vision.window_size) == (14, 2, 56)
    p = mm.processor
    assert (p.patch_size, p.merge_size, p.temporal_patch_size, p.factor, p.patch_dim) == (14, 2, 2, 28, 1176)
    assert p.min_pixels == 56 * 56 and p.rescale_factor == pytest.approx(1 / 255)
    assert p.mean[0] == pytest.approx(0.48145466) and p.std[2] == pytest.approx(0.27577711)
    # the decoder takes embeddings and 3-row positions; the pipeline feeds both, so nothing is asked of a request
    names = {i.name: i for i in spec.inputs}
    assert "input_ids" not in names and spec.inputs_embeds_name == "inputs_embeds"
    assert names["position_ids"].shape[0] == 3
    assert spec.extra_inputs == ()


@pytest.fixture
def pkg(qwen_vl_dir, tmp_path) -> Path:
    dst = tmp_path / "pkg"
    shutil.copytree(qwen_vl_dir, dst)
    return dst


def edit(path: Path, fn) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


def test_a_speech_section_is_refused_by_name(pkg):
    edit(pkg / "genai_config.json", lambda c: c["model"].update(speech={"filename": "speech.onnx"}))
    with pytest.raises(UnsupportedModel, match=r"model\.speech section .*no speech graphs"):
        load_spec(pkg)


def test_a_vision_section_of_another_model_type_is_refused(pkg):
    edit(pkg / "genai_config.json", lambda c: c["model"].update(type="phi3"))
    with pytest.raises(
        UnsupportedModel, match=r"model\.vision of model\.type 'phi3' is not supported.*qwen2_5_vl"
    ):
        load_spec(pkg)


def test_an_unknown_image_transform_is_refused_by_name(pkg):
    def add(doc):
        doc["processor"]["transforms"].append({"operation": {"name": "x", "type": "CenterCrop"}})

    edit(pkg / "processor_config.json", add)
    with pytest.raises(UnsupportedModel, match="image transform 'CenterCrop' is not supported"):
        load_spec(pkg)


def test_missing_graphs_and_configs_name_the_file(pkg):
    (pkg / "vision.onnx").unlink()
    with pytest.raises(MissingModelFile, match=r"vision\.onnx.*model\.vision\.filename") as e:
        load_spec(pkg)
    assert e.value.path == pkg / "vision.onnx"


def test_a_missing_processor_config_is_named(pkg):
    (pkg / "processor_config.json").unlink()
    with pytest.raises(MissingModelFile, match=r"processor_config\.json"):
        load_spec(pkg)


def test_mismatched_geometry_and_missing_ids_are_invalid_configs(pkg, tmp_path):
    edit(pkg / "genai_config.json", lambda c: c["model"]["vision"].update(patch_size=16))
    with pytest.raises(InvalidConfig, match=r"differ from model\.vision's") as e:
        load_spec(pkg)
    assert e.value.key == "model.vision.patch_size"
    edit(pkg / "genai_config.json", lambda c: c["model"]["vision"].update(patch_size=14))
    edit(pkg / "genai_config.json", lambda c: c["model"].pop("image_token_id"))
    with pytest.raises(InvalidConfig) as e:
        load_spec(pkg)
    assert e.value.key == "model.image_token_id"
    edit(pkg / "genai_config.json", lambda c: c["model"].update(image_token_id=5))
    edit(pkg / "genai_config.json", lambda c: c["model"].pop("embedding"))
    with pytest.raises(InvalidConfig, match=r"needs model\.embedding"):
        load_spec(pkg)


def _image(serial: int, h: int, w: int) -> ImageInput:
    return ImageInput(bytes([serial]) * 16, serial, None, (1, h, w), 2)


def test_image_keys_name_each_image_token_and_unkey_gives_the_placeholders_back():
    a, b = _image(0, 2, 4), _image(7, 4, 4)  # 2 and 4 tokens
    ids = [1, 3, 5, 5, 4, 9, 3, 5, 5, 5, 5, 4]
    keyed = key_images(ids, 5, [a, b])
    assert keyed[:2] == [1, 3] and keyed[4:7] == [4, 9, 3] and keyed[-1] == 4
    assert [split_key(t) for t in keyed[2:4]] == [(0, 0), (0, 1)]
    assert [split_key(t) for t in keyed[7:11]] == [(7, 0), (7, 1), (7, 2), (7, 3)]
    assert split_key(9) is None and min(keyed[2:4]) >= KEY_BASE and image_key(7, 3) == keyed[10]
    assert unkey(keyed, 5) == ids
    # two images back to back (no marker between them) are told apart by their lengths
    assert [split_key(t) for t in key_images([5, 5, 5, 5, 5, 5], 5, [a, b])] == [
        (0, 0), (0, 1), (7, 0), (7, 1), (7, 2), (7, 3)
    ]  # fmt: skip
    with pytest.raises(ValueError, match="more image placeholders than images"):
        key_images(ids, 5, [a])
    with pytest.raises(ValueError, match="more images than placeholders"):
        key_images(ids[:5], 5, [a, b])
    with pytest.raises(ValueError, match="cut short"):
        key_images([5, 9], 5, [a])


def test_a_fixture_shape_with_a_projection_as_wide_as_the_vocabulary_is_refused(tmp_path):
    """onnxruntime-genai's builder takes any Linear of `vocab_size` outputs for the lm_head (a vision block's
    projection of that width became one, with its bias): such a shape is refused before anything is built."""
    from onnxgen.convert.qwen_vl import VLShape, random_qwen_vl_checkpoint

    with pytest.raises(ValueError, match="vocab_size 384 equals a projection's width"):
        random_qwen_vl_checkpoint(tmp_path / "hf", VLShape(vision_hidden=384))
    assert not (tmp_path / "hf").exists()
