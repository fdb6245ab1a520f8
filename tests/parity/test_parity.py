"""Parity of onnxgen (ort backend) on the real SmolLM2 fp32 package against independent references:
HF transformers on the same weights loaded from the GGUF, and onnxruntime-genai on the same package."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from onnxgen.package.home import sources_dir

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how photosynthesis works, step by step.",
    "Give me five tips for learning a new programming language, with a sentence on each.",
]
N_TOKENS = 64


def chat(q: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": q}]


@pytest.fixture(scope="module")
def hf_model(smollm2_dir: Path):
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM

    from onnxgen.convert.default import GGUF_NAME

    gguf = sources_dir() / GGUF_NAME  # other real models keep their GGUFs beside it
    assert gguf.is_file(), "the default build keeps its GGUF under $ONNXGEN_HOME/sources"
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def onnxgen_runs(smollm2_ort):
    return [
        smollm2_ort.generate(chat(q), max_new_tokens=N_TOKENS, output_logits=True, reuse=False)
        for q in PROMPTS
    ]


def test_greedy_tokens_and_logits_match_transformers(smollm2_ort, hf_model, onnxgen_runs):
    import torch

    long_enough = 0
    for run in onnxgen_runs:
        ids = torch.tensor([run.prompt_ids])
        with torch.no_grad():
            out = hf_model.generate(
                ids,
                max_new_tokens=N_TOKENS,
                do_sample=False,
                eos_token_id=list(smollm2_ort.eos_token_ids),
                output_logits=True,
                return_dict_in_generate=True,
                attention_mask=torch.ones_like(ids),
            )
        hf_tokens = out.sequences[0, ids.shape[1] :].tolist()
        assert run.tokens == hf_tokens
        long_enough += len(run.tokens) >= 60
        # last-position logits of every step within 1e-3 absolute
        hf_logits = torch.stack(out.logits)[:, 0].numpy()
        assert hf_logits.shape == run.logits.shape
        assert float(np.max(np.abs(hf_logits - run.logits))) < 1e-3
    assert long_enough >= 3, "each prompt must produce >= 60 tokens for the parity claim"


def test_greedy_tokens_match_onnxruntime_genai(smollm2_dir, onnxgen_runs):
    og = pytest.importorskip("onnxruntime_genai")
    model = og.Model(str(smollm2_dir))
    for run in onnxgen_runs:
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(run.prompt_ids) + N_TOKENS)
        gen = og.Generator(model, params)
        gen.append_tokens(run.prompt_ids)
        tokens: list[int] = []
        while not gen.is_done() and len(tokens) < N_TOKENS:
            gen.generate_next_token()
            tokens.append(int(gen.get_next_tokens()[0]))
        # onnxruntime-genai stops on EOS without reporting it in some versions; compare the common part
        assert run.tokens[: len(tokens)] == tokens
        assert len(tokens) >= min(len(run.tokens), N_TOKENS) - 1
