"""The image pipeline against independent references on the tiny Qwen2.5-VL fixture (`convert/qwen_vl.py`):
transformers' Qwen2_5_VLForConditionalGeneration on the same weights (its own image processor, its own MRoPE
positions) with one and two images, greedy tokens and every step's logits, on both backends, in one prefill
and in chunks that cut images in two; and onnxruntime-genai 0.18 running the same package (its processor)."""

from __future__ import annotations

import io

import numpy as np
import pytest

import onnxgen
from onnxgen.package.attachments import unkey
from tests.conftest import native_available

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL")
N = 10
PAD = 5  # the fixture's <|image_pad|>


def _png(h: int, w: int, seed: int) -> bytes:
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


# 56 x 84 is a multiple of 28 (kept as is); 100 x 70 is resized (bicubic) to 112 x 56
IMAGES = [_png(56, 84, 0), _png(100, 70, 1)]
BACKENDS = [
    "ort",
    pytest.param(
        "native", marks=pytest.mark.skipif(not native_available(), reason="native backend not importable")
    ),
]


def messages(n_images: int) -> list[dict]:
    parts = [{"type": "image"} for _ in range(n_images)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is in the picture?"}]}]


@pytest.fixture(scope="module")
def hf(qwen_vl_dirs):
    import torch

    torch.set_num_threads(2)
    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_vl_dirs[0]).eval()


def hf_greedy(hf, ids: list[int], images: list[bytes], n: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens and logits; the pixels from its own (PIL) Qwen2-VL image processor."""
    import torch
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    proc = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=448 * 448)
    px = proc(images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images], return_tensors="pt")
    t = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(
            t,
            attention_mask=torch.ones_like(t),
            pixel_values=px["pixel_values"],
            image_grid_thw=px["image_grid_thw"],
            mm_token_type_ids=(t == PAD).int(),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(ids) :].tolist(), torch.stack(out.logits)[:, 0].numpy()


@pytest.fixture(scope="module", params=BACKENDS)
def model(request, qwen_vl_dir):
    m = onnxgen.load(str(qwen_vl_dir), backend=request.param, threads=2)
    yield m
    m.close()


@pytest.mark.parametrize("n_images", [1, 2])
def test_greedy_output_with_images_equals_transformers(model, hf, n_images):
    prepared = model.prepare(
        messages(n_images), images=IMAGES[:n_images], max_new_tokens=N, output_logits=True, reuse=False
    )
    assert len(prepared.images) == n_images
    ids = unkey(prepared.ids, PAD)
    assert ids.count(PAD) == sum(im.tokens for im in prepared.images) == (6 if n_images == 1 else 14)
    r = model.generate(prepared)
    ref_tokens, ref_logits = hf_greedy(hf, ids, IMAGES[:n_images], N)
    assert r.tokens == ref_tokens
    err = np.linalg.norm(r.logits - ref_logits, axis=1) / np.linalg.norm(ref_logits, axis=1)
    assert err.max() < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunks_that_cut_images_equal_one_prefill(qwen_vl_dir, backend):
    whole = onnxgen.load(str(qwen_vl_dir), backend=backend, threads=2)
    chunked = onnxgen.load(str(qwen_vl_dir), backend=backend, threads=2, chunk_size=5)
    a = whole.generate(messages(2), images=IMAGES, max_new_tokens=N, output_logits=True, reuse=False)
    b = chunked.generate(messages(2), images=IMAGES, max_new_tokens=N, output_logits=True, reuse=False)
    assert a.tokens == b.tokens
    assert np.abs(a.logits - b.logits).max() <= 1e-4 * np.abs(a.logits).max()
    whole.close()
    chunked.close()


def test_greedy_tokens_equal_onnxruntime_genai(qwen_vl_dir, tmp_path):
    og = pytest.importorskip("onnxruntime_genai")
    ours = onnxgen.load(str(qwen_vl_dir), backend="ort", threads=2)
    model = og.Model(str(qwen_vl_dir))
    proc = model.create_multimodal_processor()
    paths = []
    for i, data in enumerate(IMAGES):
        paths.append(str(tmp_path / f"{i}.png"))
        (tmp_path / f"{i}.png").write_bytes(data)
    for n in (1, 2):
        # images of sides that are multiples of 28: no resize, so both processors see the same pixels
        files = [paths[0], str(tmp_path / "c.png")][:n]
        (tmp_path / "c.png").write_bytes(_png(112, 56, 2))
        prompt = (
            "<|im_start|>user\n"
            + "<|vision_start|><|image_pad|><|vision_end|>" * n
            + "Describe.<|im_end|>\n<|im_start|>assistant\n"
        )
        inputs = proc(prompt, images=og.Images.open(*files))
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=200)
        gen = og.Generator(model, params)
        gen.set_inputs(inputs)
        theirs: list[int] = []
        while not gen.is_done() and len(theirs) < N:
            gen.generate_next_token()
            theirs.append(int(gen.get_next_tokens()[0]))
        mine = ours.generate(
            prompt, images=[open(f, "rb").read() for f in files], max_new_tokens=N, reuse=False
        )
        assert mine.tokens[: len(theirs)] == theirs and len(theirs) == N
    ours.close()
