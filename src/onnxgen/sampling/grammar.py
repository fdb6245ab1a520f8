"""Structured output with llguidance: a logits processor that masks every token the grammar forbids.

    from onnxgen.sampling.grammar import json_schema_processor
    proc = json_schema_processor(model, {"type": "object", "properties": {...}})
    model.generate(messages, processors=[proc])          # text is JSON that validates

Constraint kinds: `json_object` (any JSON object), `json_schema` (a JSON Schema, dict or string),
`regex` and `lark` (a Lark grammar in llguidance's dialect). Each is compiled by llguidance into a
grammar for an `LLMatcher`; invalid ones raise `onnxgen.errors.GrammarError` before generation.

Per step the processor (1) feeds the matcher the token sampled at the previous step, (2) computes
the token bitmask (llguidance drops the GIL while doing so) and (3) sets disallowed logits to -inf,
on the logits' own device for torch tensors. When the grammar is complete and cannot be extended
(a closed JSON object), llguidance allows only EOS, so generation ends with `finish_reason ==
"stop"` instead of running on to `max_new_tokens`. A grammar that admits no first token is rejected when
the processor is made (`GrammarError`, before generation); one that cannot go on mid-generation (an
llguidance limit, a dead end) raises `GrammarFailed` and fails the request: the output never ends early with
text that breaks the constraint.

The `LLTokenizer` (built from the model's tokenizer.json, ~0.5 s) is cached per tokenizer in a
`GrammarCompiler`; that cache holds no request state. A `GrammarProcessor` holds one request's
matcher; calling it with an empty `generated` list (a new request) resets it, so one processor
may serve consecutive requests, never concurrent ones.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from onnxgen.errors import GrammarError, GrammarFailed

KINDS = ("json_object", "json_schema", "regex", "lark")

# JSON is laid out like json.dumps: `{"a": 1, "b": [2, 3]}`. Flexible whitespace lets a sampling
# model wander through newlines and spaces until max_tokens; a fixed layout ends promptly. A schema
# may override it with llguidance's "x-guidance" key (e.g. {"whitespace_flexible": true}).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llg() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise GrammarError(
            "structured output needs llguidance: pip install 'onnxgen[grammar]'", field="response_format"
        ) from exc
    return llguidance


class GrammarCompiler:
    """Compiles constraints for one tokenizer. Thread-safe; build once per model (`for_model`).

    tokenizer_json: the text of tokenizer.json. vocab_size: the logits' width (may exceed the
    tokenizer's). eos_ids: the ids that end generation; the grammar allows them once complete.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]) -> None:
        llg = _llg()
        if not eos_ids:
            raise GrammarError(
                "structured output needs an EOS token id; the package defines none", field="response_format"
            )
        self.vocab_size = int(vocab_size)
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.ll_tokenizer = llg.LLTokenizer(
            tokenizer_json, n_vocab=self.vocab_size, eos_token=list(self.eos_ids)
        )

    _cache: ClassVar[weakref.WeakKeyDictionary[Any, GrammarCompiler]] = weakref.WeakKeyDictionary()
    _cache_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def for_model(cls, model: Any) -> GrammarCompiler:
        """The compiler of a loaded `onnxgen.Model` (cached per tokenizer object)."""
        return cls.for_tokenizer(model.tokenizer, model.spec.vocab_size, model.eos_token_ids)

    @classmethod
    def for_tokenizer(cls, tok: Any, vocab_size: int, eos_ids: Sequence[int]) -> GrammarCompiler:
        """The compiler of an `onnxgen.text.Tokenizer` whose logits are `vocab_size` wide (cached per
        tokenizer object)."""
        with cls._cache_lock:
            hit = cls._cache.get(tok)
            if hit is None:
                hit = cls(tok.backend.to_str(), vocab_size, eos_ids)
                cls._cache[tok] = hit
        return hit

    def compile(self, kind: str, source: Any = None) -> str:
        """An llguidance grammar (validated) for a constraint. Raises GrammarError naming the problem.

        kind: one of KINDS. source: the schema (dict or JSON text) for json_schema, the pattern for
        regex, the grammar text for lark; ignored for json_object.
        """
        llg = _llg()
        field = "response_format"
        try:
            if kind == "json_object":
                grammar = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
            elif kind == "json_schema":
                if isinstance(source, str):
                    try:
                        source = json.loads(source)
                    except json.JSONDecodeError as exc:
                        raise GrammarError(f"the JSON schema is not valid JSON: {exc}", field=field) from exc
                if not isinstance(source, Mapping):
                    raise GrammarError("the JSON schema must be a JSON object", field=field)
                grammar = llg.LLMatcher.grammar_from_json_schema(dict(source), defaults=JSON_LAYOUT)
            elif kind == "regex":
                if not isinstance(source, str) or not source:
                    raise GrammarError("the regex must be a non-empty string", field=field)
                grammar = llg.LLMatcher.grammar_from_regex(source)
            elif kind == "lark":
                if not isinstance(source, str) or not source.strip():
                    raise GrammarError("the Lark grammar must be a non-empty string", field=field)
                grammar = llg.LLMatcher.grammar_from_lark(source)
            else:
                raise GrammarError(
                    f"unknown constraint kind {kind!r}; use one of {', '.join(KINDS)}", field=field
                )
        except (ValueError, TypeError) as exc:
            if isinstance(exc, GrammarError):
                raise
            raise GrammarError(f"invalid {kind}: {exc}", field=field) from exc
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_error:
            raise GrammarError(
                f"invalid {kind}: {messages[0] if messages else 'rejected by llguidance'}", field=field
            )
        return grammar

    def processor(self, kind: str, source: Any = None) -> GrammarProcessor:
        """A fresh processor for one request's constraint (see `compile` for the arguments)."""
        return GrammarProcessor(self, self.compile(kind, source))


class GrammarProcessor:
    """Masks the logits of tokens the grammar does not allow next. One request at a time.

    Works on numpy arrays and torch tensors (the mask is applied on the tensor's device).
    `finished` tells whether the grammar is complete (accepting) after the tokens seen so far.
    """

    def __init__(self, compiler: GrammarCompiler, grammar: str) -> None:
        llg = _llg()
        self.compiler = compiler
        self.matcher = llg.LLMatcher(compiler.ll_tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"invalid grammar: {self.matcher.get_error()}", field="response_format")
        n_words = (compiler.vocab_size + 31) // 32
        self._bits = np.zeros(n_words, dtype=np.int32)
        self._fed = 0
        self._torch_eos: Any = None
        self._first: np.ndarray | None = None
        try:
            self._first = self.allowed()
        except GrammarFailed as exc:
            raise GrammarError(str(exc), field="response_format") from None
        if not self._first.any():
            raise GrammarError("the grammar admits no output", field="response_format")

    @property
    def finished(self) -> bool:
        return bool(self.matcher.is_accepting())

    def _sync(self, generated: Sequence[int]) -> None:
        if len(generated) < self._fed:  # a new request on the same processor
            self.matcher.reset()
            self._fed = 0
        for tok in generated[self._fed :]:
            self.matcher.consume_token(int(tok))  # never raises; an error state is handled below
        self._fed = len(generated)

    def _failed(self) -> GrammarFailed:
        first = (self.matcher.get_error() or "no token is allowed").strip().splitlines()[0]
        return GrammarFailed(
            f"structured output could not go on after {self._fed} tokens (llguidance: {first})",
            field="response_format",
        )

    def allowed(self, generated: Sequence[int] = ()) -> np.ndarray:
        """Boolean mask [vocab_size] of the tokens allowed after `generated` (advances the matcher). Raises
        `GrammarFailed` when the matcher cannot go on (an llguidance limit, or no token allowed)."""
        if not generated and self._fed == 0 and self._first is not None:
            first, self._first = self._first, None  # computed when the processor was made
            return first
        self._sync(generated)
        m = self.matcher
        if m.is_error():
            raise self._failed()
        m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if m.is_error():
            raise self._failed()
        bits = np.unpackbits(self._bits.view(np.uint8), count=self.compiler.vocab_size, bitorder="little")
        allowed = bits.view(bool)
        if not allowed.any():
            raise self._failed()
        return allowed

    def __call__(self, logits: Any, generated: Sequence[int]) -> Any:
        allowed = self.allowed(generated)
        if type(logits).__module__.startswith("torch"):
            import torch

            mask = torch.from_numpy(allowed).to(logits.device, non_blocking=True)
            n = min(mask.shape[0], logits.shape[-1])
            logits[..., :n].masked_fill_(~mask[:n], float("-inf"))
            if logits.shape[-1] > n:
                logits[..., n:] = float("-inf")
            return logits
        x = (
            logits
            if isinstance(logits, np.ndarray) and logits.dtype.kind == "f"
            else np.asarray(logits, np.float32)
        )
        n = min(allowed.shape[0], x.shape[-1])
        np.copyto(x[..., :n], np.float32(-np.inf), where=~allowed[:n])
        if x.shape[-1] > n:
            x[..., n:] = -np.inf
        return x


def grammar_processor(model: Any, kind: str, source: Any = None) -> GrammarProcessor:
    """A processor constraining `model`'s output (kind: json_object | json_schema | regex | lark)."""
    return GrammarCompiler.for_model(model).processor(kind, source)


def json_schema_processor(model: Any, schema: Mapping[str, Any] | str) -> GrammarProcessor:
    """Constrain output to JSON that validates against `schema`."""
    return grammar_processor(model, "json_schema", schema)


def json_object_processor(model: Any) -> GrammarProcessor:
    """Constrain output to any JSON object."""
    return grammar_processor(model, "json_object")


def regex_processor(model: Any, pattern: str) -> GrammarProcessor:
    """Constrain output to text matching `pattern` (whole output)."""
    return grammar_processor(model, "regex", pattern)


def lark_processor(model: Any, grammar: str) -> GrammarProcessor:
    """Constrain output to a Lark grammar (llguidance dialect; `start` is the top rule)."""
    return grammar_processor(model, "lark", grammar)
