"""Requests with images on the tiny Qwen2.5-VL (`convert/qwen_vl.py`), both backends: reuse keyed by the images
(docs/reuse.md, invariant 4: an image's tokens carry its key, `package/attachments.py`), the vision features
cached by digest, the typed error of an image placeholder without its image, other failures unchanged, several
image requests at once, and a context holding images never saved."""

from __future__ import annotations

import io

import numpy as np
import pytest

import onnxgen
from onnxgen.backends import multimodal
from onnxgen.errors import InvalidRequest, MissingRequiredInput
from onnxgen.package.attachments import unkey
from tests.conftest import native_available

pytest.importorskip("PIL")
BACKENDS = [
    "ort",
    pytest.param(
        "native", marks=pytest.mark.skipif(not native_available(), reason="native backend not importable")
    ),
]
PAD = 5


def png(h: int, w: int, seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(
        buf, format="PNG"
    )
    return buf.getvalue()


A, B = png(392, 448, 0), png(392, 448, 1)  # 14 x 16 merged patches: 224 image tokens each


def turn1() -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]


def turn2(reply: str) -> list[dict]:
    return [*turn1(), {"role": "assistant", "content": reply}, {"role": "user", "content": "More?"}]


@pytest.fixture(scope="module", params=BACKENDS)
def model(request, qwen_vl_dir):
    m = onnxgen.load(str(qwen_vl_dir), backend=request.param, threads=2)
    yield m
    m.close()


@pytest.fixture
def vision_runs(monkeypatch):
    """The digests the vision graph ran for (a cache hit runs nothing)."""
    ran: list[bytes] = []
    original = multimodal.Parts.features

    def spy(self, image):
        before = self.vision_runs
        out = original(self, image)
        if self.vision_runs > before:
            ran.append(image.digest)
        return out

    monkeypatch.setattr(multimodal.Parts, "features", spy)
    return ran


def test_a_second_turn_with_the_same_image_reuses_its_prompt_and_equals_a_fresh_run(model, vision_runs):
    before = model.kv_stats()
    s = model.session()
    r1 = s.generate(turn1(), images=[A], max_new_tokens=8)
    assert len(vision_runs) == 1
    r2 = s.generate(turn2(r1.text), images=[A], max_new_tokens=8, output_logits=True)
    # a fresh run on the ids turn 2 ran on (the reply keeps the ids the model produced: docs/reuse.md)
    fresh = model.generate(
        unkey(r2.prompt_ids, PAD), images=[A], max_new_tokens=8, output_logits=True, reuse=False
    )
    assert fresh.prompt_ids == r2.prompt_ids and r2.tokens == fresh.tokens
    assert np.abs(r2.logits - fresh.logits).max() <= 1e-4 * np.abs(fresh.logits).max()
    st = r2.stats
    assert (
        st.reused_tokens >= 0.9 * st.prompt_tokens
        and st.prefilled_tokens == st.prompt_tokens - st.reused_tokens
    )
    # turn 2 found the image's KV; the fresh run found its features: the vision graph ran for turn 1 only
    assert len(vision_runs) == 1
    after = model.kv_stats()  # the same counts, public
    assert after["vision_runs"] - before["vision_runs"] == 1
    assert after["vision_cache_hits"] - before["vision_cache_hits"] == 1 and after["images_cached"] >= 1
    s.close()


def test_a_different_image_at_the_same_position_reuses_nothing_from_the_image_on(model):
    s = model.session()
    r1 = s.generate(turn1(), images=[A], max_new_tokens=8)
    prepared = model.prepare(turn2(r1.text), images=[B], max_new_tokens=8, output_logits=True)
    first_image_token = unkey(prepared.ids, PAD).index(PAD)
    r2 = s.generate(prepared)
    assert 0 < r2.stats.reused_tokens <= first_image_token  # only the text before the image
    fresh = model.generate(
        unkey(r2.prompt_ids, PAD), images=[B], max_new_tokens=8, output_logits=True, reuse=False
    )
    assert fresh.prompt_ids == r2.prompt_ids and r2.tokens == fresh.tokens
    assert np.abs(r2.logits - fresh.logits).max() <= 1e-4 * np.abs(fresh.logits).max()
    # stateless requests too: the one retained context under another image shares only the text before it
    model.generate(turn1(), images=[A], max_new_tokens=4)
    again = model.generate(turn1(), images=[A], max_new_tokens=4)
    other = model.generate(turn1(), images=[B], max_new_tokens=4)
    assert again.stats.reused_tokens > first_image_token and other.stats.reused_tokens <= first_image_token
    s.close()


def test_an_image_placeholder_without_its_image_is_a_missing_required_input(model):
    with pytest.raises(MissingRequiredInput, match="pixel_values") as e:
        model.generate(turn1(), max_new_tokens=2)
    assert e.value.name == "pixel_values" and "1 image placeholder(s) but 0 image(s)" in str(e.value)
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "x"}]}]
    with pytest.raises(MissingRequiredInput):
        model.generate(two, images=[A], max_new_tokens=2)
    for ids in ([10, PAD, 11], [10, PAD] * 3):  # token ids too: one placeholder per image, or expanded
        with pytest.raises(MissingRequiredInput, match=r"\d image placeholder\(s\) but 0 image"):
            model.generate(ids, max_new_tokens=2)
    # other failures keep their own error: more images than placeholders, an undecodable image, a remote URL
    with pytest.raises(InvalidRequest, match="2 images came with a prompt that has 1"):
        model.generate(turn1(), images=[A, B], max_new_tokens=2)
    with pytest.raises(InvalidRequest, match="could not be decoded"):
        model.generate(turn1(), images=[b"not an image"], max_new_tokens=2)
    url = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}],
        }
    ]
    with pytest.raises(InvalidRequest, match="remote URLs are not fetched"):
        model.generate(url, max_new_tokens=2)
    # the model still runs correctly afterwards
    assert model.generate(turn1(), images=[A], max_new_tokens=2).stats.generated_tokens == 2


def test_a_failing_vision_graph_keeps_its_own_error_and_drops_the_session_state(model, monkeypatch):
    s = model.session()
    r1 = s.generate(turn1(), images=[A], max_new_tokens=4)

    def broken(self, image):
        raise RuntimeError("vision graph failed")

    monkeypatch.setattr(multimodal.Parts, "features", broken)
    with pytest.raises(RuntimeError, match="vision graph failed"):
        s.generate(turn2(r1.text), images=[png(56, 56, 9)], max_new_tokens=4)
    monkeypatch.undo()
    r = s.generate(turn2(r1.text), images=[A], max_new_tokens=4)
    assert r.stats.reused_tokens == 0  # the failed request dropped what the session held (invariant 2)
    s.close()


def test_requests_with_images_at_once_each_equal_their_run_alone(model):
    prompts = [([A], turn1()), ([B], turn1()), ([A, B], [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}])]  # fmt: skip
    opts = {"max_new_tokens": 6, "reuse": False, "output_logits": True}
    alone = [model.generate(p, images=im, **opts) for im, p in prompts]
    handles = [model.submit(p, images=im, **opts) for im, p in prompts]
    for h, a in zip(handles, alone, strict=True):
        r = h.result()
        assert r.tokens == a.tokens and np.abs(r.logits - a.logits).max() <= 1e-5 * np.abs(a.logits).max()
    assert np.abs(alone[0].logits[0] - alone[1].logits[0]).max() > 0.01  # the images matter


def test_image_parts_carry_their_own_data_and_a_text_package_refuses_images(model, tiny_dir):
    import base64

    url = "data:image/png;base64," + base64.b64encode(A).decode()
    parts = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                          {"type": "text", "text": "What is this?"}]}]  # fmt: skip
    a = model.generate(parts, max_new_tokens=6, reuse=False)
    b = model.generate(turn1(), images=[A], max_new_tokens=6, reuse=False)
    assert a.tokens == b.tokens
    text_only = onnxgen.load(str(tiny_dir), backend="ort", threads=1)
    with pytest.raises(InvalidRequest, match="no vision part"):
        text_only.generate(parts, max_new_tokens=2)
    text_only.close()


def test_a_context_holding_images_is_never_saved(model, tmp_path):
    s = model.session()
    s.generate(turn1(), images=[A], max_new_tokens=2)
    with pytest.raises(InvalidRequest, match="hold images cannot be saved"):
        s.save(tmp_path / "s.safetensors")
    assert not (tmp_path / "s.safetensors").exists()
    t = model.session()
    t.generate("plain text only", max_new_tokens=2)
    assert t.save(tmp_path / "t.safetensors") > 0  # a text context of the same model still can be
    s.close()
    t.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_session_pushed_out_resumes_with_its_images_from_the_host_tier_and_recomputes_from_disk(
    qwen_vl_dir, tmp_path, tier
):
    from tests.harness import loaded

    opts = {"host_kv_bytes": 1 << 30} if tier == "host" else {"kv_dir": str(tmp_path / "spill")}
    _, m = loaded(qwen_vl_dir, backend="ort", threads=2, max_sessions=1, **opts)
    a, b = m.session(), m.session()
    r1 = a.generate(turn1(), images=[A], max_new_tokens=4)
    b.generate("another conversation", max_new_tokens=2)  # pushes a out of memory
    r2 = a.generate(turn2(r1.text), images=[A], max_new_tokens=6, output_logits=True)
    fresh = m.generate(
        unkey(r2.prompt_ids, PAD), images=[A], max_new_tokens=6, output_logits=True, reuse=False
    )
    assert r2.tokens == fresh.tokens
    assert np.abs(r2.logits - fresh.logits).max() <= 1e-4 * np.abs(fresh.logits).max()
    if tier == "host":  # the host arrays come back, laid out again with the image
        assert r2.stats.reused_tokens >= len(r1.prompt_ids)
    else:  # a context holding images is never written to a file (`persist.write` refuses): it recomputes
        assert r2.stats.reused_tokens == 0
    m.close()


def test_a_warm_up_at_load_runs_on_a_vision_package(qwen_vl_dir):
    """The load-time warm-up's random prompts never hold an image placeholder (it would need its image)."""
    m = onnxgen.load(str(qwen_vl_dir), backend="ort", threads=2, warmup=True)
    assert m.generate(turn1(), images=[A], max_new_tokens=2).stats.generated_tokens == 2
    m.close()


def test_drafts_stop_before_an_image_token():
    """Prompt lookup drafts what followed an earlier occurrence; image keys there are never drafted (no sample
    can equal one, and the pipeline would lay them out as image positions)."""
    from onnxgen.engine.drafts import DraftControl
    from onnxgen.package.attachments import image_key

    keys = [image_key(3, k) for k in range(4)]
    prompt = [7, 8, 9, *keys, 10, 7, 8]
    assert DraftControl(k=4).propose(prompt, [], 4) == [9]  # [7, 8] was followed by 9, then the image
    assert DraftControl(k=4).propose([7, 8, 11, 12, *keys, 7, 8], [], 4) == [11, 12]
