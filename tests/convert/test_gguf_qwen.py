"""Qwen-family GGUF files -> Hugging Face folder -> package (`onnxgen convert FILE.gguf OUT`).

The GGUFs are written here from tiny random checkpoints (`gguf_writer.py`, fp32, llama.cpp's layout for
qwen2/qwen3), so the round trip can be checked exactly against transformers on the original checkpoint.
Qwen3's head size is not hidden/heads (as in Qwen3-0.6B): transformers reads no head_dim from a qwen3 GGUF,
and `convert/checkpoint.py` takes it from `qwen3.attention.key_length`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from onnxgen.convert.zoo import EOS, RECIPES, make_checkpoint

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime_genai")
pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

from tests.convert.gguf_writer import write_gguf  # noqa: E402


def _greedy(model, ids: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=EOS,
        )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_gguf_to_hf_round_trip_is_exact(name: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from onnxgen.convert.checkpoint import _gguf_to_hf

    hf = make_checkpoint(RECIPES[name], tmp_path / "hf")
    (tmp_path / "src").mkdir()
    gguf = write_gguf(hf, tmp_path / "src" / f"{name}.gguf")
    _gguf_to_hf(gguf, tmp_path / "back")
    a = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    ids = torch.tensor([list(range(3, 60))])
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def test_onnxgen_convert_of_a_qwen3_gguf_matches_transformers(tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    import onnxgen
    from onnxgen.convert.checkpoint import convert_checkpoint

    hf = make_checkpoint(RECIPES["qwen3"], tmp_path / "hf")
    (tmp_path / "src").mkdir()
    gguf = write_gguf(hf, tmp_path / "src" / "qwen3.gguf")
    pkg = convert_checkpoint(gguf, tmp_path / "pkg", progress=False)
    model = onnxgen.load(str(pkg), backend="ort")
    ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ids = np.random.default_rng(3).integers(3, 500, 40).tolist()
    r = model.generate(ids, max_new_tokens=16, temperature=0, reuse=False)
    assert r.tokens == _greedy(ref, ids, 16)
    text = "The quick brown fox jumps over the lazy dog."
    assert (
        model.tokenizer.encode(text, add_special_tokens=False)
        == Tokenizer.from_file(str(hf / "tokenizer.json")).encode(text).ids
    )
    model.close()
