"""The OpenAI Responses API: `POST /v1/responses`, `GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`.

    request  input (a string, or items: messages, function_call, function_call_output), instructions,
             function tools + tool_choice, text.format (json_schema, json_object), max_output_tokens,
             temperature / top_p, store, previous_response_id         → chat messages → `prepare_call`
    answer   output items (message with output_text; function_call with call_id, name, arguments), status
             completed | incomplete (max_output_tokens), usage (input_tokens_details.cached_tokens: reused)
    stream   response.created, response.in_progress, response.output_item.added, response.content_part.added,
             response.output_text.delta / .done, response.function_call_arguments.delta / .done,
             response.content_part.done, response.output_item.done, response.completed | response.incomplete;
             `error` and response.failed after a failure

A stored response (`store`, the default) keeps its conversation (the input without `instructions`, which are
never carried over, plus its output). A chain's first response runs stateless (its context goes where any
request can reuse it); a request naming a stored response as `previous_response_id` runs on the chain's
session (made then, finding the first response's context by prefix), so only the new items are prefilled. The
store is scoped to the caller's key and bounded (`ServerConfig.max_stored_responses`, oldest dropped first).
Requests take the same path as the other families (`routes.respond`).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from onnxgen.errors import APIError, GrammarError
from onnxgen.serve import openai
from onnxgen.serve.messages import check_messages, items_to_messages
from onnxgen.serve.schemas import ResponsesRequest
from onnxgen.serve.streaming import (
    Call,
    Event,
    FnCall,
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
    from onnxgen import Result, Session
    from onnxgen.serve.server import Caller, Server


@dataclass
class Stored:
    """A stored response: who may see it, its conversation (without instructions), the session it ran on,
    and its body (for GET)."""

    owner: str
    messages: list[dict[str, Any]]
    session: Session | None
    body: dict[str, Any]
    ids: tuple[int, ...] = ()  # the ids of its context: its prompt's and its output's


class ResponseStore:
    """Stored responses by id, per owner, at most `limit` (least recently stored dropped first). Thread-safe."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, item: Stored) -> None:
        with self._lock:
            self._items[rid] = item
            while len(self._items) > self.limit:
                self._items.popitem(last=False)

    def get(self, owner: str, rid: str) -> Stored | None:
        with self._lock:
            hit = self._items.get(rid)
        return hit if hit is not None and secrets.compare_digest(hit.owner, owner) else None

    def remove(self, owner: str, rid: str) -> bool:
        with self._lock:
            hit = self._items.get(rid)
            if hit is None or not secrets.compare_digest(hit.owner, owner):
                return False
            del self._items[rid]
            return True


def _tools(req: Any) -> dict[str, Any]:
    """Responses function tools (flat: type, name, description, parameters) as the engine's tool options."""
    if not req.tools:
        if req.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return {}
    tools = []
    for i, t in enumerate(req.tools):
        if t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise APIError(
                400,
                f"tools.{i}: only function tools ({{'type': 'function', 'name', 'parameters'}}) are supported",
                param=f"tools.{i}",
                code="unsupported",
            )
        fn = {
            "name": t["name"],
            "description": t.get("description") or "",
            "parameters": t.get("parameters") or {},
        }
        tools.append({"type": "function", "function": fn})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(
                400, "tool_choice must name a function: {'type': 'function', 'name'}", param="tool_choice"
            )
        choice = {"type": "function", "function": {"name": choice["name"]}}
    parallel = req.parallel_tool_calls is not False
    return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel}


def _format(server: Server, req: Any) -> Any:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    from onnxgen.sampling.grammar import grammar_processor

    try:
        if fmt.type == "json_object":
            return grammar_processor(server.model, "json_object")
        if fmt.schema_ is None:
            raise APIError(400, "text.format.schema is required for json_schema", param="text.format.schema")
        return grammar_processor(server.model, "json_schema", fmt.schema_)
    except GrammarError as exc:
        raise APIError(400, str(exc), param="text.format", code="invalid_response_format") from None


def prepare(server: Server, req: Any, history: list[dict[str, Any]]) -> tuple[Call, list[dict[str, Any]]]:
    """(the prepared call, the conversation to store: `history` + the new input). Raises APIError."""
    openai.check_model(req.model, server.model_names, server.model_id)
    conversation = history + items_to_messages(req.input)
    if not conversation:
        raise APIError(400, "input holds no message", param="input")
    prompt = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    check_messages(prompt, "input")
    call = openai.prepare_call(
        server.model,
        prompt,
        prompt_field="input",
        max_tokens=("max_output_tokens", req.max_output_tokens),
        cap=server.config.max_tokens_cap,
        sampling={"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k},
        tools=_tools(req),
        processors=[_format(server, req)],
        stream=bool(req.stream),
    )
    return call, conversation


def _usage(result: Result) -> dict[str, Any]:
    s = result.stats
    n = len(result.tokens)
    return {
        "input_tokens": s.prompt_tokens,
        "input_tokens_details": {"cached_tokens": s.reused_tokens},
        "output_tokens": n,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": s.prompt_tokens + n,
    }


def _assistant(outcome: Outcome) -> dict[str, Any]:
    """The assistant message a response adds to its stored conversation."""
    msg: dict[str, Any] = {"role": "assistant", "content": outcome.content}
    if outcome.calls:
        msg["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in outcome.calls
        ]
    elif outcome.content is None:
        msg["content"] = ""
    return msg


class Reply:
    """One Responses request's answer (`streaming.Family`); stores the response when it completes."""

    call_prefix = "call_"

    def __init__(
        self,
        server: Server,
        req: Any,
        caller: Caller,
        conversation: list[dict[str, Any]],
        session: Session | None,
    ) -> None:
        self.server = server
        self.req = req
        self.caller = caller
        self.conversation = conversation
        self.session = session
        self.id = f"resp_{secrets.token_hex(24)}"
        self.created = int(time.time())
        self.seq = 0
        self.msg_id = f"msg_{secrets.token_hex(12)}"
        self.fc_ids: dict[str, str] = {}  # call_id -> function_call item id
        self._items: list[dict[str, Any]] = []  # output items streamed so far
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._text: list[str] = []

    def _response(
        self, status: str, output: list[dict[str, Any]], usage: Any = None, error: Any = None
    ) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format.model_dump(by_alias=True) if req.text and req.text.format else {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.server.model_id,
            "output": output,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id,
            "store": req.store is not False,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tools": req.tools or [],
            "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": {"format": fmt},
            "metadata": req.metadata or {},
            "usage": usage,
        }

    def _output(self, outcome: Outcome) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if outcome.content:
            part = {"type": "output_text", "text": outcome.content, "annotations": [], "logprobs": []}
            out.append(
                {
                    "id": self.msg_id,
                    "type": "message",
                    "status": "completed",
                    "role": "assistant",
                    "content": [part],
                }
            )
        out += [self._fc(c, "completed") for c in outcome.calls]
        return out

    def _fc(self, c: FnCall, status: str) -> dict[str, Any]:
        fid = self.fc_ids.setdefault(c.id, f"fc_{secrets.token_hex(12)}")
        return {"id": fid, "type": "function_call", "status": status, "call_id": c.id, "name": c.name,
                "arguments": c.arguments}  # fmt: skip

    def _complete(self, result: Result, outcome: Outcome) -> dict[str, Any]:
        status = "incomplete" if outcome.finish == "length" else "completed"
        body = self._response(status, self._output(outcome), _usage(result))
        if self.req.store is not False:
            messages = [*self.conversation, _assistant(outcome)]
            ids = (*result.prompt_ids, *result.tokens)
            self.server.responses.put(self.id, Stored(self.caller.owner, messages, self.session, body, ids))
        return body

    def body(self, result: Result, outcome: Outcome, entries: Sequence[Any] | None) -> dict[str, Any]:
        return self._complete(result, outcome)

    # --- the stream ------------------------------------------------------------------------------------

    def _ev(self, kind: str, **data: Any) -> str:
        e = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return sse(e, kind)

    def opening(self) -> list[str]:
        r = self._response("in_progress", [])
        return [self._ev("response.created", response=r), self._ev("response.in_progress", response=r)]

    def _close(self, cut: bool = False) -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self._items) - 1
        if item["type"] == "message":
            text = "".join(self._text)
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item.update(status="completed", content=[part])
            common = {"item_id": item["id"], "output_index": index, "content_index": 0}
            return [
                self._ev("response.output_text.done", **common, text=text, logprobs=[]),
                self._ev("response.content_part.done", **common, part=part),
                self._ev("response.output_item.done", output_index=index, item=item),
            ]
        item["status"] = "incomplete" if cut else "completed"
        return [
            self._ev(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            ),
            self._ev("response.output_item.done", output_index=index, item=item),
        ]

    def event(self, e: Event) -> list[str]:
        if isinstance(e, Text):
            out = []
            if self._open is None or self._open["type"] != "message":
                out = self._close()
                item = {
                    "id": self.msg_id,
                    "type": "message",
                    "status": "in_progress",
                    "role": "assistant",
                    "content": [],
                }
                self._items.append(item)
                self._open = item
                index = len(self._items) - 1
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                out += [
                    self._ev("response.output_item.added", output_index=index, item=dict(item)),
                    self._ev(
                        "response.content_part.added", item_id=self.msg_id, output_index=index, content_index=0,
                        part=part,
                    ),
                ]  # fmt: skip
            self._text.append(e.text)
            index = len(self._items) - 1
            return [
                *out,
                self._ev(
                    "response.output_text.delta", item_id=self.msg_id, output_index=index, content_index=0,
                    delta=e.text, logprobs=[],
                ),
            ]  # fmt: skip
        if isinstance(e, ToolStart):
            out = self._close()
            item = self._fc(FnCall(e.id, e.name, ""), "in_progress")
            self._items.append(item)
            self._open = item
            return [
                *out,
                self._ev("response.output_item.added", output_index=len(self._items) - 1, item=dict(item)),
            ]
        if isinstance(e, ToolArgs) and self._open is not None:
            self._open["arguments"] += e.fragment
            return [
                self._ev(
                    "response.function_call_arguments.delta",
                    item_id=self._open["id"],
                    output_index=len(self._items) - 1,
                    delta=e.fragment,
                )
            ]
        if isinstance(e, ToolEnd):
            return self._close()
        return []

    def finish(self, result: Result, outcome: Outcome, entries: Sequence[Any] | None) -> list[str]:
        out = self._close(cut=True)
        body = self._complete(result, outcome)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return [*out, self._ev(kind, response=body)]

    def error(self, err: APIError) -> list[str]:
        failed = self._response(
            "failed", self._items, error={"code": err.code or "server_error", "message": err.message}
        )
        return [
            self._ev("error", code=err.code, message=err.message, param=err.param),
            self._ev("response.failed", response=failed),
        ]


def _chain_session(server: Server, caller: Caller, ids: tuple[int, ...]) -> Session:
    """A session for a chain of responses (from its second on; its first ran stateless, so its context is
    where any request can find it), salted as the caller's sessions are, continuing the context `ids` (so a
    reply that would re-tokenize differently keeps the ids it was generated as)."""
    salt, per_id = server.session_salt(caller)
    name = f"resp-{secrets.token_hex(4)}"
    return server.model.session(name, salt=secrets.token_hex(16) if per_id else salt, history=ids)


def add_routes(app: Any, server: Server) -> None:
    """`POST /v1/responses`, `GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`."""
    server.responses = ResponseStore(server.config.max_stored_responses)

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        server.authenticate(request)
        req = await read_body(server, request, ResponsesRequest)
        caller = server.caller(request, req.cache_salt)
        session = await server.resolve_session(request, caller)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prev = server.responses.get(caller.owner, req.previous_response_id)
            if prev is None:
                raise APIError(
                    404,
                    f"unknown response {req.previous_response_id!r} (not stored, deleted, or expired)",
                    param="previous_response_id",
                    code="response_not_found",
                )
            history = prev.messages
            if session is None:  # NOTE: the conversation's KV, so only the new items are prefilled
                session = prev.session
                if session is None or session.closed:  # the chain's second response: it gets a session
                    session = _chain_session(server, caller, prev.ids)
                    prev.session = session
        call, conversation = await server.run_off_loop(prepare, server, req, history)
        family = Reply(server, req, caller, conversation, session)
        return await respond(server, request, call, family, session or caller)

    @app.get("/v1/responses/{rid}")
    async def retrieve(rid: str, request: Request) -> dict[str, Any]:
        owner = server.authenticate(request)
        hit = server.responses.get(owner, rid)
        if hit is None:
            raise APIError(404, f"unknown response {rid!r}", param="response_id", code="response_not_found")
        return hit.body

    @app.delete("/v1/responses/{rid}")
    async def delete(rid: str, request: Request) -> dict[str, Any]:
        owner = server.authenticate(request)
        if not server.responses.remove(owner, rid):
            raise APIError(404, f"unknown response {rid!r}", param="response_id", code="response_not_found")
        return {"id": rid, "object": "response.deleted", "deleted": True}
