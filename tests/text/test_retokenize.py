"""Reuse that survives re-tokenization. A client sends the history back with the model's reply as text, and
that text does not always re-tokenize into the ids that were sampled. The engine keeps the ids the session
generated for the span the text spells (`Model.encode(history=...)`), so turn 2 reuses every retained
token, and the result equals a fresh run on the same ids."""

from __future__ import annotations

import pytest

import onnxgen

QUESTIONS = [
    "Name three rivers in France.",  # its reply re-tokenizes differently at the 57th token
    "Write a haiku about autumn.",
    "What's 17 times 23? Show your work.",
    "List three French cheeses.",
    "Translate 'good morning' into Japanese and Chinese.",
    "Give me a URL-safe slug for 'Hello, World! 2024'.",
    "Name two emoji that mean happiness.",
]


def _two_turns(model, q: str, temperature: float, seed: int, max_new_tokens: int = 64):
    s = model.session()
    history = [{"role": "user", "content": q}]
    r1 = s.generate(history, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    held = r1.prompt_ids + r1.tokens[:-1]  # what the session's cache holds
    history += [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "Thanks. One more?"}]
    plain = model.encode(history)
    r2 = s.generate(history, max_new_tokens=4, temperature=0.0, output_logits=True)
    s.close()
    return r1, held, plain, r2


def _check(model, r1, held, plain, r2) -> bool:
    """Asserts the turn-2 contract; returns whether plain re-tokenization reproduced the sampled ids."""
    assert r2.prompt_ids[: len(held)] == held  # the generated ids are kept...
    assert r2.stats.reused_tokens == len(held)  # ...so every retained token is reused
    assert model.tokenizer.decode(r2.prompt_ids) == model.tokenizer.decode(plain)  # the same text
    fresh = model.generate(r2.prompt_ids, max_new_tokens=4, temperature=0.0, output_logits=True, reuse=False)
    assert r2.tokens == fresh.tokens
    return plain[: len(held)] == held


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_turn_two_reuses_every_retained_token(smollm2_ort, temperature):
    differs = 0
    for i, q in enumerate(QUESTIONS):
        differs += not _check(smollm2_ort, *_two_turns(smollm2_ort, q, temperature, seed=i))
    if temperature == 0.0:
        assert differs >= 1, "at least one reply must re-tokenize differently for this test to mean anything"


def test_native_backend_keeps_the_generated_ids_too(smollm2_dir):
    model = onnxgen.load(str(smollm2_dir), backend="native")
    r1, held, plain, r2 = _two_turns(model, QUESTIONS[0], 0.0, seed=0)
    assert not _check(model, r1, held, plain, r2)  # this reply re-tokenizes differently; all is reused anyway


def test_plain_encoding_is_kept_when_it_reproduces_the_ids(smollm2_ort):
    s = smollm2_ort.session()
    history = [{"role": "user", "content": "What is the capital of France?"}]
    r1 = s.generate(history, max_new_tokens=32, temperature=0)
    history += [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "And of Spain?"}]
    assert smollm2_ort.encode(history, history=r1.prompt_ids + r1.tokens[:-1]) == smollm2_ort.encode(history)
    edited = [*history[:1], {"role": "assistant", "content": "Something else."}, history[2]]
    kept = smollm2_ort.encode(edited, history=r1.prompt_ids + r1.tokens[:-1])
    assert kept == smollm2_ort.encode(edited)  # an edited reply: nothing to keep beyond plain encoding


def test_a_new_prompt_is_never_split_where_held_text_ends(tiny_dir) -> None:
    """Only generated ids are kept: a new prompt that merely starts with the text of a held prompt's prefix
    ("... client 10" after a held "... client 1") is tokenized as a fresh run would tokenize it, not as the
    held ids + the rest ("1" + "0"). Found by 32 concurrent clients on one key's default session."""
    model = onnxgen.load(str(tiny_dir), backend="ort", threads=1)
    s = model.session()
    for c in range(12):  # one session, unrelated prompts: each turn holds the previous one's context
        msgs = [{"role": "user", "content": f"client {c} says hello number {c * 7}"}]
        r = s.generate(msgs, max_new_tokens=3, temperature=0.0)
        assert r.prompt_ids == model.encode(msgs), c


def test_a_reply_with_invalid_utf8_keeps_every_id(smollm2_ort) -> None:
    """A sampled reply can hold a character's first bytes followed by no continuation (found at temperature
    0.9: "\\xef\\xbc" then " **"). Its text decodes that sequence to U+FFFD; a client echoing the text back
    still keeps every id, and the rest is encoded as usual."""
    tok = smollm2_ort.tokenizer
    table = tok.bytes_table()
    lead = next(i for i, b in enumerate(table) if len(b) == 2 and b[0] >= 0xE0 and b[1] & 0xC0 == 0x80)
    held = (
        tok.encode("The answer is", add_special_tokens=False)
        + [lead]
        + tok.encode(" done", add_special_tokens=False)
    )
    text = tok.decode(held)
    assert "\ufffd" in text
    ids = tok.encode_after(text + " And more.", held)
    assert ids[: len(held)] == held
    assert tok.decode(ids) == text + " And more."
    broken = text.replace("\ufffd", "?")  # a client that changed the text keeps only what still matches
    kept = tok.encode_after(broken, held)
    assert tok.decode(kept) == broken and kept[: len(held)] != held


def test_an_evicted_session_encodes_its_next_prompt_the_same(smollm2_ort) -> None:
    """The ids a turn runs on do not depend on whether the session's KV survived eviction (32 clients over a
    registry of 8 found it): the session keeps the ids of its last context, so only the reuse is lost."""
    q = QUESTIONS[0]  # its reply re-tokenizes differently
    kept, evicted = smollm2_ort.session(), smollm2_ort.session()
    history = [{"role": "user", "content": q}]
    r1 = kept.generate(history, max_new_tokens=64, temperature=0)
    assert evicted.generate(history, max_new_tokens=64, temperature=0).tokens == r1.tokens
    assert evicted.evict() > 0
    history += [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "Thanks. One more?"}]
    a = kept.generate(history, max_new_tokens=4, temperature=0)
    b = evicted.generate(history, max_new_tokens=4, temperature=0)
    assert b.stats.reused_tokens < a.stats.reused_tokens  # the KV is gone...
    assert b.prompt_ids == a.prompt_ids != smollm2_ort.encode(history)  # ...the generated ids are not
    assert b.tokens == a.tokens
    evicted.clear()  # /reset forgets the ids too
    assert evicted.generate(history, max_new_tokens=4, temperature=0).prompt_ids == smollm2_ort.encode(
        history
    )
