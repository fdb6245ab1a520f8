"""The OpenAI mapping: request fields → `Session.generate` keyword arguments; results → response bodies.

    /v1/chat/completions ─┐                                        ┌─ plain:  Reply.body(result, entries)
                          ├─ prepare(model, req, prompt, kind) ────┤
    /v1/completions ──────┘   → Prepared (prompt, generate kwargs) └─ stream: Reply.opening / chunk / usage_chunk

The two endpoints share this one path and differ only in shape (`Kind`): the prompt field, the objects'
names, how a choice carries its output (`message` / `delta` vs `text`) and its logprobs (`content` entries
vs parallel lists with text offsets). Plain data only (no FastAPI); the model is used only through its public
API (`prepare`, `spec`, `tokenizer`, `eos_token_ids`).
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from onnxgen.errors import APIError, GrammarError, InvalidRequest
from onnxgen.serve.errors import error_body, from_engine_error
from onnxgen.serve.streaming import Call, Event, Outcome, Text, ToolArgs, ToolStart, sse

if TYPE_CHECKING:
    from onnxgen import Model, Result

MAX_STOP = 16  # OpenAI's limit is 4; more is harmless, but a bound keeps stop matching cheap


@dataclass(frozen=True)
class Kind:
    """What differs between chat completions and completions."""

    chat: bool
    prompt_field: str  # the request field a prompt error names
    id_prefix: str
    object: str
    chunk_object: str


CHAT = Kind(True, "messages", "chatcmpl-", "chat.completion", "chat.completion.chunk")
COMPLETION = Kind(False, "prompt", "cmpl-", "text_completion", "text_completion")


# --- request → generate keyword arguments -------------------------------------------------------------


def check_model(name: Any, model_names: Collection[str], model_id: str) -> None:
    """400 unless `name` is one of the names this server answers to."""
    if name not in model_names:
        raise APIError(
            400,
            f"unknown model {name!r}; this server serves {model_id!r}",
            param="model",
            code="model_not_found",
        )


def check_stops(stop: Any, field: str = "stop") -> tuple[str, ...]:
    """The stop strings of a request (a string or a list of at most `MAX_STOP` non-empty strings)."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP or not all(stops):
        raise APIError(
            400, f"{field} must be at most {MAX_STOP} non-empty strings", param=field, code="invalid_value"
        )
    return tuple(stops)


def prepare_call(
    model: Model,
    prompt: Any,
    *,
    prompt_field: str,
    max_tokens: tuple[str, int | None],
    cap: int,
    stop: Sequence[str] = (),
    sampling: dict[str, Any] | None = None,
    tools: dict[str, Any] | None = None,
    processors: Sequence[Any] = (),
    recorder: Any = None,
    speculative: Any = None,
    stream: bool = False,
    include_usage: bool = False,
) -> Call:
    """The one preparation every family ends in: `Model.prepare` (the prompt encoded, the tool and format
    grammars compiled; a grammar that cannot be compiled or admits no output is a 400 here), then the token
    limit checked (`max_tokens`: the field's name and value). Encodes the prompt (milliseconds for a long
    one: call it off the event loop). Raises APIError naming the field."""
    try:
        prepared = model.prepare(
            prompt,
            stop=list(stop) or None,
            processors=[p for p in (recorder, *processors) if p is not None],
            speculative=speculative,
            **(sampling or {}),
            **(tools or {}),
        )
    except Exception as exc:
        raise from_engine_error(exc, prompt_field=prompt_field) from None
    field, n = max_tokens
    max_new = _max_new_tokens(field, n, len(prepared.ids), model.spec.context_length, cap)
    return Call(
        dataclasses.replace(prepared, max_new_tokens=max_new),
        recorder=recorder,
        stream=stream,
        include_usage=include_usage,
        stops=tuple(stop),
        prompt_field=prompt_field,
    )


def prepare(
    model: Model, req: Any, prompt: Any, kind: Kind, *, model_id: str, model_names: Collection[str], cap: int
) -> Call:
    """Validate everything that can be validated before the request is queued (so every problem is a 400,
    for streams too) and prepare it once (`prepare_call`). Raises APIError naming the field."""
    from onnxgen.sampling.processors import LogprobsRecorder

    field = kind.prompt_field
    check_model(req.model, model_names, model_id)
    if req.n not in (None, 1):
        raise APIError(400, "only n=1 is supported", param="n", code="invalid_value")
    stop = check_stops(req.stop)
    sampling = {
        "temperature": req.temperature,
        "top_k": req.top_k,
        "top_p": req.top_p,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "seed": req.seed,
    }
    tools: dict[str, Any] = {}
    recorder = None
    limit: tuple[str, int | None] = ("max_tokens", req.max_tokens)
    try:
        if kind.chat:
            if req.max_completion_tokens is not None:
                limit = ("max_completion_tokens", req.max_completion_tokens)
            if req.tools or req.tool_choice is not None:
                parallel = req.parallel_tool_calls is not False
                tools = {"tools": req.tools, "tool_choice": req.tool_choice, "parallel_tool_calls": parallel}
            if req.top_logprobs is not None and not req.logprobs:
                raise APIError(
                    400, "top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value"
                )
            if req.logprobs:
                recorder = LogprobsRecorder(req.top_logprobs or 0)  # checks top_logprobs in [0, 20]
        else:
            _check_completion_only(req)
            if req.logprobs is not None:
                if not 0 <= req.logprobs <= 5:  # the completions API's own bound (LogprobsRecorder takes 20)
                    raise APIError(
                        400,
                        f"logprobs must be in [0, 5], got {req.logprobs}",
                        param="logprobs",
                        code="invalid_value",
                    )
                recorder = LogprobsRecorder(req.logprobs)
    except InvalidRequest as exc:
        raise from_engine_error(exc, prompt_field=field) from None
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise APIError(400, "stream_options needs stream=true", param="stream_options", code="invalid_value")
    return prepare_call(
        model,
        prompt,
        prompt_field=field,
        max_tokens=limit,
        cap=cap,
        stop=stop,
        sampling=sampling,
        tools=tools,
        processors=[_logit_bias(model, req.logit_bias), response_format(model, req.response_format)],
        recorder=recorder,
        speculative=req.speculative,
        stream=stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
    )


def _max_new_tokens(field: str, n: int | None, prompt_tokens: int, context_length: int, cap: int) -> int:
    """The request's token limit `n` (sent as `field`), checked here once. NOTE: the engine checks
    `max_new_tokens >= 1` too, but only once the request runs (a stream has answered 200 by then) and in
    the Python API's name; this range check answers before queueing and names the field the client sent,
    and the cap and the context room are limits of the server. Omitted: as many as fit, up to the cap."""
    room = context_length - prompt_tokens
    if n is None:
        return min(cap, room)
    if not 1 <= n <= cap:
        raise APIError(
            400,
            f"{field} must be between 1 and this server's cap of {cap} tokens per request, got {n}",
            param=field,
            code="invalid_value",
        )
    if n > room:
        raise APIError(
            400,
            f"the prompt ({prompt_tokens} tokens) plus {field} ({n}) exceeds the model's context "
            f"length ({context_length}); lower {field} to at most {room} or shorten the prompt",
            param=field,
            code="context_length_exceeded",
        )
    return n


def _check_completion_only(req: Any) -> None:
    if req.echo:
        raise APIError(400, "echo is not supported", param="echo", code="unsupported")
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix", code="unsupported")
    if req.best_of not in (None, 1):
        raise APIError(400, "only best_of=1 is supported", param="best_of", code="invalid_value")


def _logit_bias(model: Model, bias: dict[str, float] | None) -> Any:
    if not bias:
        return None
    from onnxgen.sampling.processors import LogitBias

    try:
        return LogitBias({int(k): v for k, v in bias.items()}, model.spec.vocab_size)
    except ValueError as exc:
        raise APIError(400, f"logit_bias: {exc}", param="logit_bias", code="invalid_value") from None


def response_format(model: Model, rf: Any, param: str = "response_format") -> Any:
    """The llguidance processor of a `response_format` (None for text); 400 naming `param` when invalid."""
    if rf is None or rf.type == "text":
        return None
    from onnxgen.sampling.grammar import grammar_processor

    try:
        if rf.type == "json_object":
            return grammar_processor(model, "json_object")
        if rf.type == "json_schema":
            if rf.json_schema is None:
                raise APIError(
                    400,
                    f"{param}.json_schema is required for type json_schema",
                    param=f"{param}.json_schema",
                    code="invalid_value",
                )
            return grammar_processor(model, "json_schema", rf.json_schema.schema_)
        if rf.type == "regex":
            return grammar_processor(model, "regex", rf.regex)
        return grammar_processor(model, "lark", rf.grammar)
    except GrammarError as exc:
        raise APIError(400, str(exc), param=param, code="invalid_response_format") from None


# --- result → response bodies -------------------------------------------------------------------------


def usage(result: Result) -> dict[str, Any]:
    s = result.stats
    n = len(result.tokens)
    return {
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": n,
        "total_tokens": s.prompt_tokens + n,
        "prompt_tokens_details": {"cached_tokens": s.reused_tokens},
    }


class Logprobs:
    """Logprob entries (`TokenLogprob`) in the two OpenAI shapes, with the model's tokenizer."""

    def __init__(self, model: Model) -> None:
        self._tokenizer = model.tokenizer
        self._eos = frozenset(model.eos_token_ids)

    def visible(self, entries: Sequence[Any], result: Any | None = None) -> list[Any]:
        """The entries of the tokens that produced text (drops a final EOS)."""
        if result is not None and result.tokens and result.tokens[-1] in self._eos:
            return list(entries[: len(result.tokens) - 1])
        return [e for e in entries if e.token not in self._eos]

    def text(self, tok: int) -> str:
        return self._tokenizer.decode([tok])

    def chat(self, entries: Sequence[Any]) -> dict[str, Any]:
        def item(tok: int, lp: float) -> dict[str, Any]:
            # `token` is text (a partial UTF-8 sequence decodes to U+FFFD); `bytes` are the token's own
            # bytes, so the bytes of consecutive tokens rebuild multi-byte characters
            return {"token": self.text(tok), "logprob": lp, "bytes": list(self._tokenizer.token_bytes(tok))}

        return {
            "content": [
                {**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                for e in entries
            ]
        }

    def completion(self, entries: Sequence[Any], offset: int = 0) -> dict[str, Any]:
        tokens, lps, tops, offsets = [], [], [], []
        for e in entries:
            text = self.text(e.token)
            tokens.append(text)
            lps.append(e.logprob)
            tops.append({self.text(t): lp for t, lp in e.top})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


class Reply:
    """One request's answer in its kind's shape (`streaming.Family`): `body` for a plain response; `opening`,
    `event`, `finish` and `error` for a stream (a completion's text offset is tracked, so call them in order).
    Tool calls stream as OpenAI's do: the call's id and name first, then its arguments in fragments."""

    call_prefix = "call_"

    def __init__(self, kind: Kind, model_id: str, logprobs: Logprobs, include_usage: bool = False) -> None:
        self.kind = kind
        self.logprobs = logprobs
        self.id = kind.id_prefix + secrets.token_hex(12)
        self.created = int(time.time())
        self.model_id = model_id
        self.include_usage = include_usage
        self._usage_null = {"usage": None} if include_usage else {}
        self._offset = 0  # characters streamed so far (completions' text_offset)

    def _head(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model_id,
            "system_fingerprint": None,
        }

    def _logprobs(self, entries: Sequence[Any] | None, offset: int = 0) -> dict[str, Any] | None:
        if entries is None:
            return None
        return self.logprobs.chat(entries) if self.kind.chat else self.logprobs.completion(entries, offset)

    def body(self, result: Result, outcome: Outcome, entries: Sequence[Any] | None) -> dict[str, Any]:
        """The whole response of a finished request (`entries`: its visible logprob entries, or None)."""
        if self.kind.chat:
            msg: dict[str, Any] = {"role": "assistant", "content": outcome.content}
            if outcome.calls:
                msg["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in outcome.calls
                ]
            output: dict[str, Any] = {"message": msg}
        else:
            output = {"text": result.text}
        choice = {"index": 0, **output, "logprobs": self._logprobs(entries), "finish_reason": outcome.finish}
        return {**self._head(self.kind.object), "choices": [choice], "usage": usage(result)}

    def _chunk(
        self, delta: dict[str, Any] | None, entries: Sequence[Any] | None = None, finish: str | None = None
    ) -> str:
        if self.kind.chat:
            choice = {
                "index": 0,
                "delta": delta or {},
                "logprobs": self._logprobs(entries),
                "finish_reason": finish,
            }
        else:
            piece = (delta or {}).get("content") or ""
            choice = {
                "index": 0,
                "text": piece,
                "logprobs": self._logprobs(entries, self._offset),
                "finish_reason": finish,
            }
            self._offset += len(piece)
        return sse({**self._head(self.kind.chunk_object), "choices": [choice], **self._usage_null})

    def opening(self) -> list[str]:
        """Chat announces the assistant's role; completions, nothing."""
        return [self._chunk({"role": "assistant", "content": ""})] if self.kind.chat else []

    def event(self, e: Event) -> list[str]:
        if isinstance(e, Text):
            return [self._chunk({"content": e.text}, e.entries)]
        if isinstance(e, ToolStart):
            call = {
                "index": e.index,
                "id": e.id,
                "type": "function",
                "function": {"name": e.name, "arguments": ""},
            }
            return [self._chunk({"tool_calls": [call]}, e.entries)]
        if isinstance(e, ToolArgs):
            return [
                self._chunk(
                    {"tool_calls": [{"index": e.index, "function": {"arguments": e.fragment}}]}, e.entries
                )
            ]
        return [self._chunk({}, e.entries)] if e.entries else []

    def finish(self, result: Result, outcome: Outcome, entries: Sequence[Any] | None) -> list[str]:
        out = [self._chunk(None, entries, outcome.finish)]
        if self.include_usage:
            out.append(sse({**self._head(self.kind.chunk_object), "choices": [], "usage": usage(result)}))
        return [*out, "data: [DONE]\n\n"]

    def error(self, err: APIError) -> list[str]:
        return [sse(error_body(err)), "data: [DONE]\n\n"]
