"""The HTTP routes, thin: authenticate → read the body → map (openai.py, anthropic.py, responses.py) → one
path for every family (`streaming.respond`: submit → a whole response, or the family's event stream).

    GET /health · GET /metrics · GET /v1/models · GET /v1/models/{id}
    POST /v1/chat/completions · POST /v1/completions                     OpenAI (openai.py)
    POST /v1/messages · POST /v1/messages/count_tokens                    Anthropic (anthropic.py)
    POST /v1/responses · GET|DELETE /v1/responses/{id}                    OpenAI Responses (responses.py)
    POST /v1/sessions · POST /v1/sessions/{id}/save · DELETE /v1/sessions/{id}
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from onnxgen.errors import APIError
from onnxgen.serve import anthropic, openai, responses
from onnxgen.serve.messages import chat_messages, completion_prompt
from onnxgen.serve.schemas import ChatCompletionRequest, CompletionRequest
from onnxgen.serve.sessions import SESSION_EXTENSION, SESSION_HEADER
from onnxgen.serve.streaming import read_body, respond

if TYPE_CHECKING:
    from onnxgen.serve.server import Server

ROUTES = (
    "/health",
    "/metrics",
    "/v1/models",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/v1/sessions",
)


def route_label(path: str) -> str:
    """The route a request path is counted under in /metrics (ids folded, unknown paths "other")."""
    if path in ROUTES:
        return path
    for prefix in ("/v1/sessions/", "/v1/responses/", "/v1/models/"):
        if path.startswith(prefix):
            return prefix + "{id}"
    return "other"


def add_routes(app: Any, server: Server) -> None:
    """Register every route of the server on the FastAPI `app`."""

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok"}  # NOTE: nothing about other callers' traffic (that is /metrics')

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        server.authorize_metrics(request)
        return PlainTextResponse(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        server.authenticate(request)
        return {
            "object": "list",
            "data": [
                {"id": server.model_id, "object": "model", "created": server.created, "owned_by": "onnxgen"}
            ],
        }

    @app.get("/v1/models/{model_name:path}")
    async def model_info(model_name: str, request: Request) -> dict[str, Any]:
        server.authenticate(request)
        if model_name not in server.model_names:
            raise APIError(
                404,
                f"unknown model {model_name!r}; this server serves {server.model_id!r}",
                param="model",
                code="model_not_found",
            )
        return {"id": model_name, "object": "model", "created": server.created, "owned_by": "onnxgen"}

    @app.post("/v1/sessions")
    async def create_session(request: Request) -> JSONResponse:
        caller = server.caller(request)
        await server.close_expired()
        sid = server.create_session(caller, request.scope.get("extensions", {}).get(SESSION_EXTENSION))
        return JSONResponse(
            {"id": sid, "object": "session", "created": int(time.time())}, headers={SESSION_HEADER: sid}
        )

    @app.post("/v1/sessions/{sid}/save")
    async def save_session(sid: str, request: Request) -> dict[str, Any]:
        owner = server.authenticate(request)
        if server.store.kv_dir is None:
            raise APIError(
                400, "this server keeps no session files: start it with --kv-dir DIR", code="kv_dir_not_set"
            )
        saved = await server.run_off_loop(server.store.save, owner, sid)
        if saved is None:
            raise APIError(404, f"unknown session {sid!r}", param="session_id", code="session_not_found")
        tokens, size = saved
        return {"id": sid, "object": "session.saved", "tokens": tokens, "bytes": size}

    @app.delete("/v1/sessions/{sid}")
    async def delete_session(sid: str, request: Request) -> dict[str, Any]:
        owner = server.authenticate(request)
        session = server.store.remove(owner, sid)
        path = server.store.file(owner, sid)
        if session is None and path is not None and path.is_file():  # saved, not restored since
            server.store.forget_file(owner, sid)
            return {"id": sid, "object": "session.deleted", "deleted": True}
        if session is None:
            raise APIError(404, f"unknown session {sid!r}", param="session_id", code="session_not_found")
        server.cancel_running(
            session
        )  # a running request stops at its next step; close() then returns at once
        await server.run_off_loop(session.close)
        server.store.forget_file(owner, sid)
        return {"id": sid, "object": "session.deleted", "deleted": True}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await complete(request, openai.CHAT, ChatCompletionRequest, chat_messages)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, openai.COMPLETION, CompletionRequest, completion_prompt)

    async def complete(
        request: Request, kind: openai.Kind, schema: Any, prompt_of: Callable[[Any], Any]
    ) -> Response:
        server.authenticate(request)
        req = await read_body(server, request, schema)
        caller = server.caller(request, req.cache_salt)
        session = await server.resolve_session(request, caller)
        if kind.chat and server.image_fetch is not None:  # remote images are fetched: off the event loop
            prompt = await server.run_off_loop(prompt_of, req, server.image_fetch)
        else:
            prompt = prompt_of(req)
        call = await server.run_off_loop(
            openai.prepare,
            server.model,
            req,
            prompt,
            kind,
            model_id=server.model_id,
            model_names=server.model_names,
            cap=server.config.max_tokens_cap,
        )
        family = openai.Reply(kind, server.model_id, server.logprobs, call.include_usage)
        return await respond(server, request, call, family, session or caller)

    anthropic.add_routes(app, server)
    responses.add_routes(app, server)
