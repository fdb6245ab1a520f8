"""The engine: one loaded package, its decoders, sessions and the request path.

`Engine` is what `onnxgen.load()` returns (exported as `onnxgen.Model`). One request reads as three
calls: prepare (tokens, identity, reuse plan) → run (the decode loop) → finish (result, stats).
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from onnxgen.backends import backend_options, create_decoder, resolve_backend
from onnxgen.backends.base import Decoder
from onnxgen.engine import loop
from onnxgen.engine import reuse as reuse_policy
from onnxgen.engine.identity import Identity, make_identity
from onnxgen.engine.result import Result, Stats
from onnxgen.engine.session import DecoderPool, Session, SessionRegistry
from onnxgen.errors import ContextOverflow, EmptyPrompt, InvalidRequest
from onnxgen.package.spec import ModelSpec
from onnxgen.sampling import LogitsProcessor, Sampler, SamplingParams

DEFAULT_MAX_NEW_TOKENS = 256


def _all_ints(seq: Sequence[Any]) -> bool:
    """True when every element is a plain int (bool excluded); fast for long lists of ids."""
    return set(map(type, seq)) <= {int}

Prompt = str | Sequence[Mapping[str, Any]] | Sequence[int]


def _check_backend_options(options: Mapping[str, Any]) -> None:
    """Raise `InvalidRequest` for an option no backend declares (a typo must not be silently ignored),
    naming it and every option load() takes: the engine's own keyword arguments and the options the
    backends declare (a backend ignores another's, so one set works with backend="auto")."""
    declared = sorted({o for opts in backend_options().values() for o in opts})
    for name in options:
        if name not in declared:
            params = inspect.signature(Engine.__init__).parameters.values()
            own = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
            raise InvalidRequest(
                f"unknown option {name!r}; load() takes {', '.join(own)} and the backend options "
                f"{', '.join(declared)}",
                field=name,
            )


class Engine:
    """A loaded model package ready to generate. Create with `onnxgen.load()`.

    Thread-safety: each `Session` serialises its own requests; different sessions may run
    concurrently (each has its own decoder and cache; weights are shared).
    """

    def __init__(
        self,
        spec: ModelSpec,
        *,
        backend: str = "auto",
        device: str = "cpu",
        chunk_size: int | None = None,
        max_sessions: int = 8,
        max_kv_bytes: int | None = None,
        tool_parser: str | None = None,
        **backend_options: Any,
    ) -> None:
        from onnxgen.text import ChatTemplate, Tokenizer

        self.spec = spec.with_chunk_size(chunk_size)
        self.device = device
        self.backend = resolve_backend(backend, device)
        _check_backend_options(backend_options)
        self.tokenizer = Tokenizer.from_spec(self.spec)
        self.chat_template = ChatTemplate.from_spec(self.spec, self.tokenizer)
        self.eos_token_ids = tuple(dict.fromkeys((*self.spec.eos_token_ids, *self.tokenizer.eos_token_ids)))
        self._prototype = create_decoder(self.spec, self.backend, device, **backend_options)
        self._prototype_lock = threading.Lock()
        self.pool = DecoderPool(self._new_decoder)
        # NOTE: the prototype is an ordinary decoder too; a closed decoder stays usable and still forks
        self.pool.release(self._prototype)
        self.registry = SessionRegistry(max_sessions=max_sessions, max_kv_bytes=max_kv_bytes)
        self._default_session = Session(self, name="default")
        self.package_key = f"{self.spec.path.resolve()}|{self.spec.kv_dtype}|{self.backend}|{device}"
        from onnxgen.text.tools import detect_format, get_format

        source = self.chat_template.source if self.chat_template is not None else None
        self.tool_format = get_format(tool_parser) if tool_parser else detect_format(source)

    # --- decoders & sessions -------------------------------------------------------------

    def _new_decoder(self) -> Decoder:
        """A new empty decoder sharing the loaded weights (`Decoder.fork`)."""
        with self._prototype_lock:
            return self._prototype.fork()

    def session(self, name: str | None = None) -> Session:
        """A new conversation whose KV is retained between its requests."""
        return Session(self, name)

    @property
    def default_session(self) -> Session:
        return self._default_session

    def generate(self, prompt: Prompt, **kwargs: Any) -> Result:
        """Generate on the implicit default session (so stateless callers reuse too).

        prompt: `str` (raw text), a list of `{"role", "content"}` dicts (rendered through the chat
        template) or a list of token ids. Keyword arguments: max_new_tokens, temperature, top_k,
        top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty, seed, stop,
        output_logits, on_token, reuse, inputs, processors, cancel, tools, tool_choice,
        parallel_tool_calls. See `run_request`.
        """
        return self._default_session.generate(prompt, **kwargs)

    # --- prompts -------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt, held: Sequence[int] = (),
                      tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:  # fmt: skip
        """Token ids of a prompt: raw text, chat messages or ids (validated).

        `held`: ids a session's cache holds. For chat messages whose rendering starts with exactly the
        text of a prefix of `held` (an earlier turn and the reply the model generated), that prefix is kept
        as it is and only the rest is encoded, when that keeps more of `held` than plain encoding does: a
        reply's text does not always re-tokenize into the ids that were sampled, and the model has seen
        its own ids (`Tokenizer.encode_after`). `tools`: OpenAI-style tool definitions the chat template
        sees (messages with `tool_calls` and `role: "tool"` are prepared by `onnxgen.text.tools`)."""
        if isinstance(prompt, str):
            if tools:
                raise InvalidRequest("tools need a chat prompt (a list of messages), not raw text", field="tools")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True) if prompt else []
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
            if self.chat_template is None:
                raise InvalidRequest(
                    f"{self.spec.path}: the package has no chat template; pass raw text or token ids "
                    "(or add chat_template.jinja to the package)",
                    field="prompt",
                )
            from onnxgen.text import tools as tool_text

            funcs = tool_text.function_specs(tools)
            messages = tool_text.prepare_messages(prompt, self.tool_format, self.chat_template.source, funcs)
            text = self.chat_template.render(messages, add_generation_prompt=True, tools=list(tools) if tools else None)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if held and reuse_policy.common_prefix(ids, held) < len(held):
                kept = self.tokenizer.encode_after(text, held)
                if reuse_policy.common_prefix(kept, held) > reuse_policy.common_prefix(ids, held):
                    ids = kept
        elif isinstance(prompt, Sequence) and _all_ints(prompt):
            if tools:
                raise InvalidRequest("tools need a chat prompt (a list of messages), not token ids", field="tools")
            ids = list(prompt)
            try:
                arr = np.asarray(ids, dtype=np.int64)  # NOTE: vectorised: prompts may hold many thousand ids
            except OverflowError:  # an id beyond int64
                big = str(next(i for i in ids if not -(2**63) <= i < 2**63))
                big = big if len(big) <= 24 else f"{big[:12]}...({len(big)} digits)"
                raise InvalidRequest(
                    f"token id {big} is outside the vocabulary [0, {self.spec.vocab_size})", field="prompt"
                ) from None
            if ids and (arr.min() < 0 or arr.max() >= self.spec.vocab_size):
                bad = int(arr[(arr < 0) | (arr >= self.spec.vocab_size)][0])
                raise InvalidRequest(
                    f"token id {bad} is outside the vocabulary [0, {self.spec.vocab_size})", field="prompt"
                )
        else:
            raise InvalidRequest(
                "prompt must be a string, a list of {'role', 'content'} messages, or a list of token ids",
                field="prompt",
            )
        if not ids:
            raise EmptyPrompt()
        if len(ids) >= self.spec.context_length:
            raise ContextOverflow(len(ids), self.spec.context_length)
        return ids

    # --- the request path ----------------------------------------------------------------

    def run_request(
        self,
        decoder: Decoder,
        held: Identity | None,
        prompt: Prompt,
        *,
        max_new_tokens: int | None = None,
        stop: str | Sequence[str] | None = None,
        output_logits: bool = False,
        on_token: Callable[[str], Any] | None = None,
        reuse: bool = True,
        inputs: Mapping[str, Any] | None = None,
        processors: Sequence[LogitsProcessor] = (),
        cancel: threading.Event | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        **sampling: Any,
    ) -> tuple[Result, Identity]:
        """Run one request on `decoder`, whose cache holds `held` (None: unknown/empty).

        `sampling` holds the `SamplingParams.resolve` keywords (temperature, top_k, top_p, min_p,
        repetition_penalty, presence_penalty, frequency_penalty, seed); None means "not given".

        Tools (chat prompts): `tools` are OpenAI-style definitions; `tool_choice` is "auto" (the default
        with tools: text or calls), "none" (text, never parsed), "required" (one or more calls) or
        `{"type": "function", "function": {"name": N}}` (calls of N). Except for "none", output is
        constrained by llguidance to text or well-formed calls in the model's format (`tool_format`)
        whose arguments validate against the tool's schema ("required"/named: calls only), and parsed
        into `Result.tool_calls` (`finish_reason` "tool_calls", `Result.content` the text around them).

        Returns the result and the identity of what the cache holds afterwards (prompt + every
        generated token except the last). Raises typed errors for bad input; backend errors
        propagate with their cause; the caller owns dropping the cache on any exception.
        """
        t0 = time.perf_counter()
        ids = self.encode_prompt(prompt, held.tokens if held is not None and reuse else (), tools=tools)
        tool_grammar = self.tool_processor(tools, tool_choice, parallel_tool_calls)
        if tool_grammar is not None:
            processors = [*processors, tool_grammar]
        if max_new_tokens is None:
            max_new_tokens = DEFAULT_MAX_NEW_TOKENS
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidRequest(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}", field="max_new_tokens")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(s, str) for s in stops):
            raise InvalidRequest("stop must be a string or a list of strings", field="stop")
        try:
            params = SamplingParams.resolve(self.spec.search, **sampling)
        except TypeError as exc:  # an unknown keyword argument
            raise InvalidRequest(f"unknown generate() argument: {exc}", field="sampling") from exc
        self._check_inputs(inputs)
        identity = make_identity(ids, inputs, self.package_key)
        reused = reuse_policy.prepare(decoder, held if reuse else None, identity)
        from onnxgen.text import IncrementalDetokenizer

        out = loop.run(
            decoder, ids, reused, Sampler(params, ids, processors),
            detokenizer=IncrementalDetokenizer(self.tokenizer),
            max_new_tokens=max_new_tokens, context_length=self.spec.context_length,
            eos_ids=self.eos_token_ids, stop=stops, chunk_size=self.spec.chunk_size, inputs=inputs,
            on_token=on_token, output_logits=output_logits, cancel=cancel,
        )  # fmt: skip
        fed = (ids + out.tokens)[: out.fed]
        n = len(out.tokens)
        stats = Stats(
            prompt_tokens=len(ids),
            reused_tokens=reused,
            prefilled_tokens=len(ids) - reused,
            generated_tokens=n,
            ttft_s=out.ttft_s,
            decode_tok_s=(n - 1) / out.decode_s if n > 1 and out.decode_s > 0 else 0.0,
            total_s=time.perf_counter() - t0,
            backend=self.backend,
            device=self.device,
            chunk_size=self.spec.chunk_size,
        )
        content: str | None = out.text
        calls: list[Any] = []
        finish = out.finish_reason
        if tools and tool_choice != "none":
            content, calls = self.tool_format.parse(out.text)
            if calls:
                finish = "tool_calls"
        result = Result(
            text=out.text, tokens=out.tokens, finish_reason=finish, stats=stats,
            prompt_ids=ids, logits=out.logits, tool_calls=calls, content=content,
        )  # fmt: skip
        return result, Identity(tuple(fed), identity.digest)

    def tool_processor(self, tools: Sequence[Mapping[str, Any]] | None, choice: str | Mapping[str, Any] | None,
                        parallel: bool) -> LogitsProcessor | None:  # fmt: skip
        """The llguidance constraint of a request's tool choice (None: no tools, or "none")."""
        from onnxgen.text import tools as tool_text

        if choice is not None and not isinstance(choice, (str, Mapping)):
            raise InvalidRequest("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', ...}",
                                 field="tool_choice")  # fmt: skip
        funcs = tool_text.function_specs(tools)
        if isinstance(choice, str) and choice not in tool_text.TOOL_CHOICES:
            raise InvalidRequest(f"tool_choice must be one of {', '.join(tool_text.TOOL_CHOICES)} or a named "
                                 f"function, got {choice!r}", field="tool_choice")  # fmt: skip
        if not funcs:
            if choice not in (None, "none"):
                raise InvalidRequest(f"tool_choice {choice!r} needs a non-empty tools list", field="tool_choice")
            return None
        if choice == "none":
            return None
        required = choice == "required"
        if isinstance(choice, Mapping):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, Mapping) else None
            match = [f for f in funcs if f["name"] == name]
            if choice.get("type", "function") != "function" or not match:
                raise InvalidRequest(f"tool_choice names {name!r}, which is not among the tools "
                                     f"({', '.join(f['name'] for f in funcs)})", field="tool_choice")  # fmt: skip
            funcs, required = match, True
        from onnxgen.sampling.grammar import GrammarCompiler

        grammar = self.tool_format.lark(funcs, required=required, parallel=bool(parallel))
        return GrammarCompiler.for_model(self).processor("lark", grammar)

    def _check_inputs(self, inputs: Mapping[str, Any] | None) -> None:
        if inputs is None:
            return
        if not isinstance(inputs, Mapping):
            raise InvalidRequest("inputs must be a mapping of graph input name to array or bytes", field="inputs")
        known = {i.name for i in self.spec.extra_inputs}
        for name in inputs:
            if name not in known:
                raise InvalidRequest(
                    f"the graph has no extra input {name!r}; it accepts: {', '.join(sorted(known)) or 'none'}",
                    field="inputs",
                )

    def close(self) -> None:
        """Free the device memory of every cache this engine holds: retained sessions (they stay
        usable and reuse nothing next time) and idle pooled decoders. The weights go when the
        last engine of the package is dropped."""
        self._default_session.evict()
        self.registry.evict_all()
        self.pool.close()

    # --- what a server reads (public, read-only) -------------------------------------------------

    def retained_kv_bytes(self) -> int:
        """Bytes of KV cache this engine's sessions retain now (the default session included). Read-only,
        safe from any thread; a gauge for servers and monitoring."""
        return self.registry.total_kv_bytes()
