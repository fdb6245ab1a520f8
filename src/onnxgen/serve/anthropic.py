"""The Anthropic Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

    request  system, messages (text / tool_use / tool_result blocks), tools + tool_choice, stop_sequences,
             max_tokens, temperature / top_p / top_k        → the chat template's messages → `prepare_call`
    answer   content blocks (text, tool_use), stop_reason end_turn | max_tokens | stop_sequence | tool_use,
             usage (input_tokens: prefilled; cache_read_input_tokens: reused from the cache)
    stream   message_start, content_block_start / _delta (text_delta, input_json_delta) / _stop,
             message_delta, message_stop; `event: error` after a failure

Requests take the same path as the OpenAI routes (`routes.respond`): the same sessions (`X-Session-Id`),
the same reuse and tenancy (`x-api-key` or a bearer key), the same tool grammar, and tool input streamed as
it is generated. Errors are Anthropic-shaped (`errors.anthropic_error_body`).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from onnxgen.errors import APIError
from onnxgen.serve import openai
from onnxgen.serve.errors import anthropic_error_body
from onnxgen.serve.messages import Fetch, check_messages, image_part
from onnxgen.serve.schemas import CountTokensRequest, MessagesRequest
from onnxgen.serve.streaming import (
    Call,
    Event,
    Outcome,
    Text,
    ToolArgs,
    ToolEnd,
    ToolStart,
    read_body,
    respond,
    sse,
)

if TYPE_CHECKING:
    from onnxgen import Model, Result
    from onnxgen.serve.server import Server

_STOP = {"tool_calls": "tool_use", "length": "max_tokens"}


def _text(content: Any, where: str) -> str:
    """The text of a `system` or `tool_result` content: a string or text blocks."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for k, b in enumerate(content):
        if b.type != "text" or b.text is None:
            raise APIError(
                400, f"{where}.{k}: only text blocks are supported here, got {b.type!r}", param=f"{where}.{k}"
            )
        parts.append(b.text)
    return "\n".join(parts)


def messages_of(req: Any, fetch: Fetch | None = None) -> list[dict[str, Any]]:
    """The chat template's messages of a Messages request: `system` first; user text blocks joined; each
    `tool_result` a `tool` message answering its `tool_use_id`; assistant `tool_use` blocks as tool calls
    (`input` as JSON text); user image blocks as image parts beside the text (`messages.image_part`: a url
    source through `fetch`, refused when None). Thinking blocks are dropped. Checked by `check_messages`."""
    out: list[dict[str, Any]] = []
    system = _text(req.system, "system")
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        where = f"messages.{i}.content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        parts: list[dict[str, Any]] = []  # text and image parts in order, when the message has images
        calls: list[dict[str, Any]] = []
        for k, b in enumerate(m.content):
            if b.type == "text":
                texts.append(b.text or "")
                parts.append({"type": "text", "text": b.text or ""})
            elif b.type == "image" and m.role == "user":
                url = _image_url(getattr(b, "source", None), f"{where}.{k}")
                parts.append(image_part(url, f"{where}.{k}", fetch))
            elif b.type == "tool_use" and m.role == "assistant":
                args = json.dumps(b.input if b.input is not None else {}, ensure_ascii=False)
                calls.append(
                    {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": args}}
                )
            elif b.type == "tool_result" and m.role == "user":
                text = _text(b.content, f"{where}.{k}.content")
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": text})
            elif b.type in ("thinking", "redacted_thinking"):
                continue
            else:
                raise APIError(
                    400,
                    f"{where}.{k}: content blocks of type {b.type!r} are not supported in a {m.role} message",
                    param=f"{where}.{k}.type",
                    code="unsupported",
                )
        if len(parts) > len(texts):
            out.append({"role": m.role, "content": parts})
        elif texts or calls:
            msg: dict[str, Any] = {"role": m.role, "content": "\n".join(texts) if texts else None}
            if calls:
                msg["tool_calls"] = calls
            elif msg["content"] is None:
                msg["content"] = ""
            out.append(msg)
    return check_messages(out, "messages")


def tools_of(req: Any) -> dict[str, Any]:
    """The engine's tool options of a request: Anthropic tools as functions, and its `tool_choice` (auto, any
    → required, tool → that function, none; `disable_parallel_tool_use`)."""
    if not req.tools:
        if req.tool_choice is not None and req.tool_choice.get("type") not in (None, "auto", "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return {}
    tools = []
    for i, t in enumerate(req.tools):
        if t.input_schema is None:
            raise APIError(
                400,
                f"tools.{i}: only client tools (name, input_schema) are supported, got type {t.type!r}",
                param=f"tools.{i}",
                code="unsupported",
            )
        fn = {"name": t.name, "description": t.description or "", "parameters": t.input_schema}
        tools.append({"type": "function", "function": fn})
    tc = req.tool_choice or {"type": "auto"}
    kind = tc.get("type")
    choice: Any
    if kind == "auto":
        choice = "auto"
    elif kind == "any":
        choice = "required"
    elif kind == "none":
        choice = "none"
    elif kind == "tool" and isinstance(tc.get("name"), str):
        choice = {"type": "function", "function": {"name": tc["name"]}}
    else:
        raise APIError(
            400, "tool_choice.type must be auto, any, tool (with a name) or none", param="tool_choice"
        )
    parallel = not tc.get("disable_parallel_tool_use", False)
    return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel}


def _image_url(source: Any, where: str) -> str:
    """The URL of an image block's `source`: base64 data as a data: URL, or a `url` source's URL."""
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str):
        return f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise APIError(400, f"{where}: an image block needs a base64 or url source", param=f"{where}.source")


def prepare(server: Server, req: Any) -> Call:
    """A Messages request validated and prepared once (`openai.prepare_call`). Raises APIError naming the field."""
    openai.check_model(req.model, server.model_names, server.model_id)
    stops = openai.check_stops(req.stop_sequences, "stop_sequences")
    sampling = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k}
    return openai.prepare_call(
        server.model,
        messages_of(req, server.image_fetch),
        prompt_field="messages",
        max_tokens=("max_tokens", req.max_tokens),
        cap=server.config.max_tokens_cap,
        stop=stops,
        sampling=sampling,
        tools=tools_of(req),
        stream=bool(req.stream),
    )


def usage(result: Result) -> dict[str, Any]:
    """Anthropic's usage: `input_tokens` are the prompt tokens computed, `cache_read_input_tokens` those the
    cache supplied (their sum is the prompt)."""
    s = result.stats
    return {
        "input_tokens": s.prompt_tokens - s.reused_tokens,
        "cache_read_input_tokens": s.reused_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": len(result.tokens),
    }


class Reply:
    """One Messages request's answer (`streaming.Family`)."""

    call_prefix = "toolu_"

    def __init__(self, model: Model, model_id: str, call: Call) -> None:
        self.model = model
        self.model_id = model_id
        self.call = call
        self.id = f"msg_{secrets.token_hex(12)}"
        self._block = -1  # index of the last content block started
        self._open: str | None = None  # the type of the open block

    def _stop(self, result: Result, outcome: Outcome) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence)."""
        if outcome.finish != "stop":
            return _STOP[outcome.finish], None
        if (result.tokens and result.tokens[-1] in self.model.eos_token_ids) or not self.call.stops:
            return "end_turn", None
        tail = self.model.tokenizer.decode(result.tokens)[len(result.text) :]
        hits = [(tail.find(s), s) for s in self.call.stops if s in tail]
        return "stop_sequence", (min(hits)[1] if hits else self.call.stops[0])

    def _message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None], use: Any) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model_id,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": use,
        }

    def body(self, result: Result, outcome: Outcome, entries: Sequence[Any] | None) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if outcome.content:
            content.append({"type": "text", "text": outcome.content})
        for c in outcome.calls:
            content.append({"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)})
        return self._message(content, self._stop(result, outcome), usage(result))

    # --- the stream ------------------------------------------------------------------------------------

    def opening(self) -> list[str]:
        n = len(self.call.prepared.ids)
        use = {
            "input_tokens": n,
            "cache_read_input_tokens": 0,
            "cache_creation_input_tokens": 0,
            "output_tokens": 0,
        }
        return [
            sse({"type": "message_start", "message": self._message([], (None, None), use)}, "message_start")
        ]

    def _start(self, block: dict[str, Any]) -> list[str]:
        out = self._close()
        self._block += 1
        self._open = block["type"]
        start = {"type": "content_block_start", "index": self._block, "content_block": block}
        return [*out, sse(start, "content_block_start")]

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        return [sse({"type": "content_block_stop", "index": self._block}, "content_block_stop")]

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse(
            {"type": "content_block_delta", "index": self._block, "delta": delta}, "content_block_delta"
        )

    def event(self, e: Event) -> list[str]:
        if isinstance(e, Text):
            out = [] if self._open == "text" else self._start({"type": "text", "text": ""})
            return [*out, self._delta({"type": "text_delta", "text": e.text})]
        if isinstance(e, ToolStart):
            return self._start({"type": "tool_use", "id": e.id, "name": e.name, "input": {}})
        if isinstance(e, ToolArgs):
            return [self._delta({"type": "input_json_delta", "partial_json": e.fragment})]
        if isinstance(e, ToolEnd):
            return self._close()
        return []

    def finish(self, result: Result, outcome: Outcome, entries: Sequence[Any] | None) -> list[str]:
        reason, seq = self._stop(result, outcome)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": seq},
            "usage": usage(result),
        }
        return [*self._close(), sse(delta, "message_delta"), sse({"type": "message_stop"}, "message_stop")]

    def error(self, err: APIError) -> list[str]:
        return [sse(anthropic_error_body(err), "error")]


def add_routes(app: Any, server: Server) -> None:
    """`POST /v1/messages` and `POST /v1/messages/count_tokens`."""

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        server.authenticate(request)
        req = await read_body(server, request, MessagesRequest)
        caller = server.caller(request, req.cache_salt)
        session = await server.resolve_session(request, caller)
        call = await server.run_off_loop(prepare, server, req)
        return await respond(
            server, request, call, Reply(server.model, server.model_id, call), session or caller
        )

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict[str, Any]:
        server.authenticate(request)
        req = await read_body(server, request, CountTokensRequest)
        openai.check_model(req.model, server.model_names, server.model_id)
        tools = tools_of(req).get("tools")
        msgs = messages_of(req)

        def count() -> int:
            from onnxgen.serve.errors import from_engine_error

            try:
                return len(server.model.encode(msgs, tools=tools))
            except Exception as exc:
                raise from_engine_error(exc) from None

        return {"input_tokens": await server.run_off_loop(count)}
