"""Stateless requests on per-request decoders (ort) reuse the contexts of earlier stateless requests: a small
stash matched by longest prefix under the identity digest (`engine.slots.Stash`). Outputs equal fresh runs;
salts and sessions keep their isolation; the stash is bounded."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import loaded

BASE = list(range(5, 60))


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path):
    return loaded(tiny_dir, backend="ort", threads=1, max_sessions=2)


def test_a_stateless_turn_reuses_the_last_turn_and_equals_a_fresh_run(tiny):
    _, m = tiny
    first = m.generate(BASE, max_new_tokens=6)
    turn2 = [*BASE, *first.tokens, 7, 8, 9]
    again = m.generate(turn2, max_new_tokens=6)
    fresh = m.generate(turn2, max_new_tokens=6, reuse=False)
    assert again.stats.reused_tokens == len(BASE) + len(first.tokens) - 1  # the last sample was never fed
    assert again.tokens == fresh.tokens and fresh.stats.reused_tokens == 0


def test_interleaved_conversations_each_find_their_own_context(tiny):
    _, m = tiny
    a, b = [11, *BASE], [12, *BASE]
    ra, rb = m.generate(a, max_new_tokens=3), m.generate(b, max_new_tokens=3)
    ra2 = m.generate([*a, *ra.tokens, 3], max_new_tokens=3)
    rb2 = m.generate([*b, *rb.tokens, 3], max_new_tokens=3)
    assert ra2.stats.reused_tokens == len(a) + 2 and rb2.stats.reused_tokens == len(b) + 2


def test_salts_share_nothing_and_the_stash_is_bounded(tiny):
    engine, m = tiny
    prompt = [13, *BASE]
    m.generate(prompt, max_new_tokens=2, salt="tenant-a")
    other = m.generate(prompt, max_new_tokens=2, salt="tenant-b")
    same = m.generate(prompt, max_new_tokens=2, salt="tenant-a")
    assert other.stats.reused_tokens == 0 and same.stats.reused_tokens == len(prompt) - 1
    for i in range(4):
        m.generate([20 + i, *BASE], max_new_tokens=2)
    assert engine.executor.stats()["stateless_contexts"] == 2  # max_sessions


def test_a_failed_stateless_request_leaves_nothing_behind(tiny):
    _, m = tiny
    prompt = [14, *BASE]
    m.generate(prompt, max_new_tokens=2)
    h = m.submit([*prompt, 1, 2], max_new_tokens=50, on_token=lambda _: h.cancel())
    with pytest.raises(Exception, match="cancel"):
        h.result(60)
    again = m.generate([*prompt, 1, 2], max_new_tokens=2)
    fresh = m.generate([*prompt, 1, 2], max_new_tokens=2, reuse=False)
    assert (
        again.stats.reused_tokens == 0 and again.tokens == fresh.tokens
    )  # the cancelled one took the context


def test_a_session_continuing_a_stateless_turn_finds_its_whole_context(tiny):
    """`Model.session(history=...)`: the reply's ids are kept where the next prompt's text spells them, so the
    stateless turn's cached context is reused whole even when its text re-tokenizes differently."""
    _, m = tiny
    first = [{"role": "user", "content": "continue this conversation"}]
    r1 = m.generate(first, max_new_tokens=12)
    turn2 = [*first, {"role": "assistant", "content": r1.text}, {"role": "user", "content": "and then?"}]
    s = m.session(history=[*r1.prompt_ids, *r1.tokens])
    r2 = s.generate(turn2, max_new_tokens=2)
    assert r2.stats.reused_tokens == len(r1.prompt_ids) + len(r1.tokens) - 1
    assert r2.prompt_ids[: len(r1.prompt_ids) + len(r1.tokens) - 1] == [*r1.prompt_ids, *r1.tokens][:-1]
