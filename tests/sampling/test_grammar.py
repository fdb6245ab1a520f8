"""llguidance constraints: compile errors are GrammarError, masks agree with an independent
enumeration of the language, numpy and torch paths agree, and generation ends when complete."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llguidance")

import onnxgen
from onnxgen.errors import GrammarError
from onnxgen.sampling.grammar import GrammarCompiler, grammar_processor, json_schema_processor


@pytest.fixture(scope="module")
def model(tiny_dir: Path):
    return onnxgen.load(str(tiny_dir), backend="ort", threads=1)


@pytest.fixture(scope="module")
def compiler(model) -> GrammarCompiler:
    return GrammarCompiler.for_model(model)


@pytest.mark.parametrize(
    ("kind", "source"),
    [
        ("json_schema", {"type": "objectx"}),
        ("json_schema", {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}),
        ("json_schema", "{not json"),
        ("json_schema", [1, 2]),
        ("regex", "(unclosed"),
        ("regex", ""),
        ("lark", "start: undefined_rule"),
        ("lark", "   "),
        ("xml", "<a/>"),
    ],
)
def test_invalid_constraints_raise_grammar_error(compiler, kind, source):
    with pytest.raises(GrammarError) as exc:
        compiler.processor(kind, source)
    assert exc.value.field == "response_format" and str(exc.value)


def test_compiler_is_cached_per_tokenizer(model, compiler):
    assert GrammarCompiler.for_model(model) is compiler


def _reference_allowed(model, language: list[str], prefix: str) -> np.ndarray:
    """Tokens t with prefix + decode(t) a proper-or-full prefix of a word of `language`; EOS iff
    prefix is a full word. Computed from the tokenizer alone, independently of llguidance."""
    vocab = model.spec.vocab_size
    ref = np.zeros(vocab, dtype=bool)
    for t in range(vocab):
        if t in model.eos_token_ids:
            ref[t] = prefix in language
            continue
        piece = model.tokenizer.decode([t])
        if piece and "\ufffd" not in piece and any(w.startswith(prefix + piece) for w in language):
            ref[t] = True
    return ref


def test_regex_mask_matches_enumerated_language(model, compiler):
    language = ["ab", "abc", "ba", "bb"]
    proc = compiler.processor("regex", "ab|abc|ba|bb")
    generated: list[int] = []
    prefix = ""
    for step in ("a", "b"):
        allowed = proc.allowed(generated)
        ref = _reference_allowed(model, language, prefix)
        # llguidance may also allow byte-fragment tokens; every clean token must agree exactly
        clean = np.array(
            [("\ufffd" not in model.tokenizer.decode([t])) for t in range(model.spec.vocab_size)]
        )
        assert np.array_equal(allowed & clean, ref & clean), step
        tok = model.tokenizer.encode(step, add_special_tokens=False)
        assert len(tok) == 1
        generated.append(tok[0])
        prefix += step
    allowed = proc.allowed(generated)  # after "ab": EOS or "c"
    assert allowed[list(model.eos_token_ids)].all()
    assert np.array_equal(allowed & clean, _reference_allowed(model, language, "ab") & clean)


def test_numpy_and_torch_masks_agree(compiler, model):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(model.spec.vocab_size).astype(np.float32)
    a = compiler.processor("json_object")(logits.copy(), [])
    b = compiler.processor("json_object")(torch.from_numpy(logits.copy()), []).numpy()
    assert np.array_equal(np.isinf(a), np.isinf(b)) and np.isinf(a).any() and not np.isinf(a).all()
    assert np.array_equal(a[~np.isinf(a)], logits[~np.isinf(a)])


def test_regex_generation_ends_at_completion(model):
    # random weights: the grammar alone makes the output valid and ends it with EOS
    for seed in range(3):
        proc = grammar_processor(model, "regex", "[0-9]{3}")
        r = model.session().generate(
            "digits:", processors=[proc], max_new_tokens=50, temperature=1.0, seed=seed
        )
        assert r.finish_reason == "stop" and r.tokens[-1] in model.eos_token_ids
        assert len(r.text) == 3 and r.text.isdigit(), r.text


def test_json_schema_generation_validates(model):
    schema = {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "c": {"enum": ["x", "y"]},
        },
        "required": ["ok", "n", "c"],
        "additionalProperties": False,
    }
    proc = json_schema_processor(model, schema)
    for seed in range(3):  # one processor serves consecutive requests (reset on an empty history)
        r = model.session().generate(
            "json:", processors=[proc], max_new_tokens=80, temperature=1.0, seed=seed
        )
        assert r.finish_reason == "stop", r.text
        value = json.loads(r.text)
        assert set(value) == {"ok", "n", "c"} and isinstance(value["ok"], bool)
        assert 0 <= value["n"] <= 99 and value["c"] in ("x", "y")


def test_lark_grammar(model):
    proc = grammar_processor(model, "lark", 'start: "yes" | "no"')
    r = model.session().generate("answer:", processors=[proc], max_new_tokens=10, temperature=1.0, seed=1)
    assert r.text in ("yes", "no") and r.finish_reason == "stop"
