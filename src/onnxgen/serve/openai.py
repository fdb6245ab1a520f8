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
from onnxgen.serve.errors import from_engine_error

if TYPE_CHECKING:
    from onnxgen import Model, Prepared, Result

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


@dataclass(frozen=True)
class Call:
    """A request validated and prepared, ready to queue: `prepared` is what `Session.submit` takes (the
    prompt encoded once, grammars compiled), with what the response needs (the logprobs recorder, streaming,
    usage in the stream)."""

    prepared: Prepared
    recorder: Any  # LogprobsRecorder | None
    stream: bool
    include_usage: bool

    @property
    def tool_marker(self) -> str:
        """How a tool call starts ("" without tools), for a stream to hold such text back."""
        return self.prepared.tool_marker


# --- request → prompt ---------------------------------------------------------------------------------


def chat_messages(req: Any) -> list[dict[str, Any]]:
    """The chat template's messages (`developer` is `system`; text content parts joined by newlines)."""
    messages = []
    for i, m in enumerate(req.messages):
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": _flatten_content(m.content, i)}
        if m.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.content is None:
                msg["content"] = None
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        messages.append(msg)
    return messages


def completion_prompt(req: Any) -> Any:
    """The completion's one prompt: text or token ids (a list of one prompt is that prompt)."""
    prompt: Any = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(
                400, "only one prompt per request is supported", param="prompt", code="invalid_value"
            )
        prompt = prompt[0]
    return prompt


def _flatten_content(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise APIError(
                400,
                f"content parts of type {part.type!r} are not supported (text only)",
                param=f"messages.{i}.content",
                code="unsupported",
            )
        parts.append(part.text)
    return "\n".join(parts)


# --- request → generate keyword arguments -------------------------------------------------------------


def prepare(
    model: Model, req: Any, prompt: Any, kind: Kind, *, model_id: str, model_names: Collection[str], cap: int
) -> Call:
    """Validate everything that can be validated before the request is queued (so every problem is a 400,
    for streams too) and prepare it once (`Model.prepare`: the prompt encoded, the tool and format grammars
    compiled), for `Session.submit`. Encodes the prompt (milliseconds for a long one: call it off the event
    loop). Raises APIError naming the field."""
    from onnxgen.sampling.processors import LogprobsRecorder

    field = kind.prompt_field
    if req.model not in model_names:
        raise APIError(
            400,
            f"unknown model {req.model!r}; this server serves {model_id!r}",
            param="model",
            code="model_not_found",
        )
    if req.n not in (None, 1):
        raise APIError(400, "only n=1 is supported", param="n", code="invalid_value")
    stop = req.stop
    if isinstance(stop, list) and (len(stop) > MAX_STOP or not all(stop)):
        raise APIError(
            400, f"stop must be at most {MAX_STOP} non-empty strings", param="stop", code="invalid_value"
        )
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
    try:
        if kind.chat:
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
    processors = [
        p
        for p in (recorder, _logit_bias(model, req.logit_bias), _response_format(model, req.response_format))
        if p is not None
    ]
    try:
        prepared = model.prepare(
            prompt,
            stop=stop or None,
            processors=processors,
            speculative=req.speculative,
            **sampling,
            **tools,
        )
    except Exception as exc:
        raise from_engine_error(exc, prompt_field=field) from None
    max_new_tokens = _max_new_tokens(req, kind, len(prepared.ids), model.spec.context_length, cap)
    return Call(
        dataclasses.replace(prepared, max_new_tokens=max_new_tokens),
        recorder,
        stream,
        bool(req.stream_options and req.stream_options.include_usage),
    )


def _max_new_tokens(req: Any, kind: Kind, prompt_tokens: int, context_length: int, cap: int) -> int:
    """`max_tokens` (chat: `max_completion_tokens` when given), checked here once. NOTE: the engine checks
    `max_new_tokens >= 1` too, but only once the request runs (a stream has answered 200 by then) and in
    the Python API's name; this range check answers before queueing and names the field the client sent,
    and the cap and the context room are limits of the server. Omitted: as many as fit, up to the cap."""
    field, n = "max_tokens", req.max_tokens
    if kind.chat and req.max_completion_tokens is not None:
        field, n = "max_completion_tokens", req.max_completion_tokens
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


def _response_format(model: Model, rf: Any) -> Any:
    """The llguidance processor of `response_format` (None for text)."""
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
                    "response_format.json_schema is required for type json_schema",
                    param="response_format.json_schema",
                    code="invalid_value",
                )
            return grammar_processor(model, "json_schema", rf.json_schema.schema_)
        if rf.type == "regex":
            return grammar_processor(model, "regex", rf.regex)
        return grammar_processor(model, "lark", rf.grammar)
    except GrammarError as exc:
        raise APIError(400, str(exc), param="response_format", code="invalid_response_format") from None


# --- result → response bodies -------------------------------------------------------------------------


def message(result: Result) -> dict[str, Any]:
    """The assistant message of a chat result: its content and, if it called tools, the calls."""
    msg: dict[str, Any] = {"role": "assistant", "content": result.content}
    if result.tool_calls:
        msg["tool_calls"] = [c.openai() for c in result.tool_calls]
    return msg


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
    """The response bodies of one request, in its kind's shape: `body` for a plain response; `opening`,
    `chunk` and `usage_chunk` for a stream (`chunk` tracks a completion's text offset, so call it in order)."""

    def __init__(self, kind: Kind, model_id: str, logprobs: Logprobs, include_usage: bool = False) -> None:
        self.kind = kind
        self.logprobs = logprobs
        self.id = kind.id_prefix + secrets.token_hex(12)
        self.created = int(time.time())
        self.model_id = model_id
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

    def body(self, result: Result, entries: Sequence[Any] | None) -> dict[str, Any]:
        """The whole response of a finished request (`entries`: its visible logprob entries, or None)."""
        output = {"message": message(result)} if self.kind.chat else {"text": result.text}
        choice = {
            "index": 0,
            **output,
            "logprobs": self._logprobs(entries),
            "finish_reason": result.finish_reason,
        }
        return {**self._head(self.kind.object), "choices": [choice], "usage": usage(result)}

    def opening(self) -> list[dict[str, Any]]:
        """The chunks a stream starts with: chat announces the assistant's role; completions, nothing."""
        if not self.kind.chat:
            return []
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return [{**self._head(self.kind.chunk_object), "choices": [choice], **self._usage_null}]

    def chunk(
        self,
        piece: str | None,
        finish: str | None = None,
        entries: Sequence[Any] | None = None,
        tool_calls: Sequence[Any] = (),
    ) -> dict[str, Any]:
        """A stream chunk carrying `piece` of text (None: none), the logprobs of its tokens, the finish
        reason on the last one, and (chat) tool calls."""
        if self.kind.chat:
            delta: dict[str, Any] = {} if piece is None else {"content": piece}
            if tool_calls:
                delta["tool_calls"] = [{"index": i, **c.openai()} for i, c in enumerate(tool_calls)]
            choice = {
                "index": 0,
                "delta": delta,
                "logprobs": self._logprobs(entries),
                "finish_reason": finish,
            }
        else:
            choice = {
                "index": 0,
                "text": piece or "",
                "logprobs": self._logprobs(entries, self._offset),
                "finish_reason": finish,
            }
            self._offset += len(piece or "")
        return {**self._head(self.kind.chunk_object), "choices": [choice], **self._usage_null}

    def usage_chunk(self, result: Result) -> dict[str, Any]:
        return {**self._head(self.kind.chunk_object), "choices": [], "usage": usage(result)}
