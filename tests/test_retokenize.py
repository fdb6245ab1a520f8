"""How often does re-tokenising an assistant reply reproduce the ids that were sampled? It decides how
much of a chat turn can be reused: the history a client sends back holds the reply as text. Where the
ids differ, reuse must stop exactly at the first differing token (never later, never earlier)."""

from __future__ import annotations

import pytest

from onnxgen.engine.reuse import common_prefix

QUESTIONS = [
    "Write a haiku about autumn.",
    "What's 17 times 23? Show your work.",
    "List three French cheeses.",
    "Translate 'good morning' into Japanese and Chinese.",
    "Give me a URL-safe slug for 'Hello, World! 2024'.",
    "Write a Python one-liner that reverses a string.",
    "Describe the colour blue to someone who cannot see.",
    "Name two emoji that mean happiness.",
]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_retokenised_replies_and_reuse_boundary(smollm2_ort, temperature, record_property):
    model = smollm2_ort
    same = 0
    for i, q in enumerate(QUESTIONS):
        s = model.session()
        history = [{"role": "user", "content": q}]
        r1 = s.generate(history, max_new_tokens=24, temperature=temperature, seed=i)
        held = r1.prompt_ids + r1.tokens[:-1]  # what the session's cache holds
        history += [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "Thanks. One more?"}]
        new_ids = model.encode_prompt(history)
        # the reply as re-tokenised inside the rendered history
        sampled = [t for t in r1.tokens if t not in model.eos_token_ids]
        seg = new_ids[len(r1.prompt_ids) : len(r1.prompt_ids) + len(sampled)]
        same += seg == sampled
        r2 = s.generate(history, max_new_tokens=4, temperature=0.0)
        expected = min(common_prefix(held, new_ids), len(new_ids) - 1)
        assert r2.stats.reused_tokens == expected  # stops exactly at the first differing token
        assert expected >= len(r1.prompt_ids)  # the whole previous prompt is always reused
        fresh = model.generate(history, max_new_tokens=4, temperature=0.0, reuse=False)
        assert r2.tokens == fresh.tokens
        s.close()
    record_property("retokenize_roundtrip", f"{same}/{len(QUESTIONS)}")
    print(f"\ntemperature {temperature}: re-tokenised reply == sampled ids in {same}/{len(QUESTIONS)} replies")
