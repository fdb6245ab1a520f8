"""The tiny Qwen2.5-VL fixture (`convert/qwen_vl.py`): its vision graph computes transformers' vision tower on
the same weights (windowed and full-attention blocks, images of several shapes), its embedding graph puts the
k-th feature row at the k-th image token, and the package is in onnxruntime-genai's layout."""

from __future__ import annotations

import json

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def hf_model(qwen_vl_dirs):
    transformers = pytest.importorskip("transformers")
    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_vl_dirs[0]).eval()


@pytest.mark.parametrize("grid", [(2, 2), (4, 6), (8, 4)])  # merged tokens per side: one window, several
def test_the_vision_graph_is_transformers_vision_tower(qwen_vl_dir, hf_model, grid):
    import torch

    gh, gw = 2 * grid[0], 2 * grid[1]
    pv = torch.randn(gh * gw, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(gh * 100 + gw))
    thw = torch.tensor([[1, gh, gw]])
    with torch.no_grad():
        ref = hf_model.model.visual(pv, grid_thw=thw).pooler_output.numpy()
    sess = ort.InferenceSession(str(qwen_vl_dir / "vision.onnx"))
    out = sess.run(None, {"pixel_values": pv.numpy(), "image_grid_thw": thw.numpy()})[0]
    assert out.shape == (grid[0] * grid[1], 64)
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()


def test_the_embedding_graph_puts_features_at_the_image_tokens(qwen_vl_dir, hf_model):
    table = hf_model.model.language_model.embed_tokens.weight.detach().numpy()
    sess = ort.InferenceSession(str(qwen_vl_dir / "embedding.onnx"))
    ids = np.array([[1, 5, 5, 9, 5, 2]], dtype=np.int64)
    rows = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    out = sess.run(None, {"input_ids": ids, "image_features": rows})[0]
    assert np.array_equal(out[0, [1, 2, 4]], rows)
    assert np.array_equal(out[0, [0, 3, 5]], table[[1, 9, 2]])
    none = sess.run(None, {"input_ids": ids[:, :1], "image_features": rows[:0]})[0]
    assert np.array_equal(none[0], table[[1]])


def test_the_package_is_in_onnxruntime_genais_layout(qwen_vl_dir):
    cfg = json.loads((qwen_vl_dir / "genai_config.json").read_text())["model"]
    assert cfg["type"] == "qwen2_5_vl" and cfg["image_token_id"] == 5
    assert cfg["decoder"]["inputs"]["inputs_embeds"] == "inputs_embeds"
    assert cfg["vision"]["inputs"] == {"pixel_values": "pixel_values", "image_grid_thw": "image_grid_thw"}
    assert cfg["embedding"]["outputs"] == {"inputs_embeds": "inputs_embeds"}
    og = pytest.importorskip("onnxruntime_genai")
    model = og.Model(str(qwen_vl_dir))  # onnxruntime-genai reads it as a vision pipeline
    assert model.create_multimodal_processor() is not None
