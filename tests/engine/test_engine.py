"""The decode loop and request handling, on a tiny synthetic package (ort backend)."""

from __future__ import annotations

import numpy as np
import pytest

import onnxgen
from onnxgen.engine.request import StopScanner
from onnxgen.errors import ContextOverflow, EmptyPrompt, InvalidRequest
from onnxgen.sampling import Sampler, SamplingParams
from tests.harness import loaded


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return onnxgen.load(str(tiny_dir), backend="ort", threads=1)


PROMPT = "The quick brown fox jumps over the lazy dog."


def test_greedy_is_deterministic_and_streams_the_same_text(tiny):
    pieces: list[str] = []
    a = tiny.generate(PROMPT, max_new_tokens=24, on_token=pieces.append, reuse=False)
    b = tiny.generate(PROMPT, max_new_tokens=24, reuse=False)
    assert a.tokens == b.tokens
    assert "".join(pieces) == a.text
    assert a.text == tiny.tokenizer.decode([t for t in a.tokens if t not in tiny.eos_token_ids])
    assert a.stats.prompt_tokens == len(tiny.encode(PROMPT))
    assert a.stats.generated_tokens == len(a.tokens)


def test_max_new_tokens_ends_with_length(tiny):
    r = tiny.generate(PROMPT, max_new_tokens=5, reuse=False)
    if r.finish_reason == "length":
        assert len(r.tokens) == 5
    else:  # EOS came first
        assert r.tokens[-1] in tiny.eos_token_ids and len(r.tokens) <= 5


def test_seeded_sampling_is_reproducible(tiny):
    kw = dict(max_new_tokens=20, temperature=1.5, top_k=0, reuse=False)
    a = tiny.generate(PROMPT, seed=1234, **kw)
    b = tiny.generate(PROMPT, seed=1234, **kw)
    c = tiny.generate(PROMPT, seed=99, **kw)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens  # 20 draws at temperature 1.5 over a 384-token vocab


def test_stop_string_spanning_token_boundary(tiny):
    ref = tiny.generate(PROMPT, max_new_tokens=40, reuse=False)
    ids = [t for t in ref.tokens if t not in tiny.eos_token_ids]
    pieces = [tiny.tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    # a stop string made of the end of token k and the start of token k+1
    for k in range(2, len(ids) - 1):
        a, b = pieces[k - 1], pieces[k]
        c = pieces[k + 1]
        left, right = b[len(a) :], c[len(b) :]
        if len(left) >= 1 and len(right) >= 1 and (left[-1:] + right[:1]).strip():
            stop = left[-1:] + right[:1]
            if stop in b[:-1] or stop in a:  # must first occur across the boundary
                continue
            break
    else:
        pytest.skip("no token boundary suited a spanning stop string")
    streamed: list[str] = []
    r = tiny.generate(PROMPT, max_new_tokens=40, stop=[stop], on_token=streamed.append, reuse=False)
    assert r.finish_reason == "stop"
    assert r.text == ref.text[: ref.text.index(stop)]
    assert "".join(streamed) == r.text
    assert stop not in r.text


def test_prompt_forms_and_errors(tiny):
    ids = tiny.encode(PROMPT)
    r1 = tiny.generate(ids, max_new_tokens=8, reuse=False)
    r2 = tiny.generate(PROMPT, max_new_tokens=8, reuse=False)
    assert r1.tokens == r2.tokens
    with pytest.raises(EmptyPrompt):
        tiny.generate("", max_new_tokens=4)
    with pytest.raises(EmptyPrompt):
        tiny.generate([], max_new_tokens=4)
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        tiny.generate([10**7], max_new_tokens=4)
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        tiny.generate(PROMPT, max_new_tokens=0)
    with pytest.raises(InvalidRequest, match="top_p"):
        tiny.generate(PROMPT, max_new_tokens=2, temperature=1.0, top_p=0.0)
    msgs = [{"role": "user", "content": "hi"}]
    assert tiny.generate(msgs, max_new_tokens=2).stats.prompt_tokens == len(
        tiny.tokenizer.encode(tiny.chat_template.render(msgs), add_special_tokens=False)
    )


def test_context_overflow_and_length_finish(tiny_dir, tmp_path):
    import json
    import shutil

    pkg = tmp_path / "short"
    shutil.copytree(tiny_dir, pkg)
    cfg = json.loads((pkg / "genai_config.json").read_text())
    cfg["model"]["context_length"] = 24
    (pkg / "genai_config.json").write_text(json.dumps(cfg))
    m = onnxgen.load(str(pkg), backend="ort", threads=1)
    with pytest.raises(ContextOverflow) as exc:
        m.generate(list(range(5, 29)), max_new_tokens=4)
    assert exc.value.prompt_tokens == 24 and "context length is 24" in str(exc.value)
    # 20 prompt tokens: at most 4 more fit in a context of 24
    r = m.generate(list(range(5, 25)), max_new_tokens=50, temperature=1.0, seed=3)
    assert r.stats.prompt_tokens + len(r.tokens) <= 24
    if r.finish_reason == "length":
        assert r.stats.prompt_tokens + len(r.tokens) == 24


def test_output_logits_are_the_raw_step_logits(tiny):
    r = tiny.generate(PROMPT, max_new_tokens=6, output_logits=True, reuse=False)
    assert r.logits.shape == (len(r.tokens), tiny.spec.vocab_size) and r.logits.dtype == np.float32
    assert [int(np.argmax(row)) for row in r.logits] == r.tokens


def test_stop_scanner_holds_back_partial_matches():
    s = StopScanner(["END"])
    assert s.feed("abc E") == ("abc ", False)
    assert s.feed("N") == ("", False)
    assert s.feed("X") == ("ENX", False)
    assert s.feed(" EN") == (" ", False)
    assert s.feed("D tail") == ("", True)
    assert s.text == "abc ENX "


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_sampler_restricts_to_top_k_and_top_p(backend):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=64).astype(np.float32) * 3
    if backend == "torch":
        torch = pytest.importorskip("torch")
        arr = torch.from_numpy(logits)
    else:
        arr = logits
    order = np.argsort(-logits)
    top3 = set(order[:3].tolist())
    s = Sampler(SamplingParams(temperature=1.0, top_k=3, seed=0))
    assert {s.sample(arr) for _ in range(200)} <= top3
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    cum = np.cumsum(probs[order])
    nucleus = set(order[: int(np.searchsorted(cum, 0.5)) + 1].tolist())
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=0))
    assert {s.sample(arr) for _ in range(200)} <= nucleus
    assert Sampler(SamplingParams()).sample(arr) == int(order[0])


def test_sampling_precedence_uses_package_defaults_when_not_given():
    from onnxgen.package.spec import SearchDefaults

    pkg = SearchDefaults(do_sample=True, temperature=0.7, top_k=12, top_p=0.9)
    p = SamplingParams.resolve(pkg)
    assert (p.temperature, p.top_k, p.top_p) == (0.7, 12, 0.9)
    p = SamplingParams.resolve(pkg, temperature=0.0, top_k=5)
    assert (p.temperature, p.top_k, p.top_p) == (0.0, 5, 0.9)
    p = SamplingParams.resolve(SearchDefaults(do_sample=False, temperature=0.7))
    assert p.greedy


@pytest.mark.parametrize("backend", ["ort", "native"])
def test_close_frees_every_cache_and_sessions_stay_usable(tiny_dir, backend):
    engine, m = loaded(tiny_dir, backend=backend, threads=1, paged=False)
    s = m.session()
    prompt = list(range(5, 40))
    first = s.generate(prompt, max_new_tokens=4)
    m.generate(prompt, max_new_tokens=4)
    m.generate(prompt, max_new_tokens=4, reuse=False)  # leaves an idle decoder (with its buffers) in the pool
    assert s.kv_bytes() > 0 and m.kv_stats()["stateless_kv_bytes"] > 0  # the stateless request's context
    assert engine.pool.idle >= 1 and engine.pool.kv_bytes() > 0
    m.close()
    assert (
        s.kv_bytes() == 0
        and m.kv_stats()["stateless_kv_bytes"] == 0
        and engine.registry.total_kv_bytes() == 0
    )
    assert engine.pool.idle == 0 and engine.pool.kv_bytes() == 0
    again = s.generate(prompt, max_new_tokens=4)  # nothing retained: computed from scratch, same tokens
    assert again.stats.reused_tokens == 0 and again.tokens == first.tokens


def test_unknown_load_option_is_an_error_naming_it(tiny_dir):
    with pytest.raises(InvalidRequest, match="chunksize") as e:
        onnxgen.load(str(tiny_dir), backend="ort", chunksize=64)
    assert "chunk_size" in str(e.value) and "graph_max_tokens" in str(e.value)
