"""The HTTP routes, thin: authenticate → read the body → map (openai.py) → submit → respond (here, or
streaming.py for `stream: true`).

    GET /health · GET /metrics · GET /v1/models · GET /v1/models/{id}
    POST /v1/chat/completions · POST /v1/completions · POST /v1/sessions · DELETE /v1/sessions/{id}
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from onnxgen.errors import APIError, Cancelled, SessionLimit
from onnxgen.serve import openai, streaming
from onnxgen.serve.bodies import read_json
from onnxgen.serve.errors import from_engine_error
from onnxgen.serve.schemas import ChatCompletionRequest, CompletionRequest
from onnxgen.serve.sessions import SESSION_HEADER

if TYPE_CHECKING:
    from onnxgen import Handle, Result
    from onnxgen.serve.server import Server

ROUTES = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/sessions")


def route_label(path: str) -> str:
    """The route a request path is counted under in /metrics (ids folded, unknown paths "other")."""
    if path in ROUTES:
        return path
    return "/v1/sessions/{id}" if path.startswith("/v1/sessions/") else "other"


def add_routes(app: Any, server: Server) -> None:
    """Register every route of the server on the FastAPI `app`."""

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": server.model_id, "queue_depth": server.depth}

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        server.authenticate(request)
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
        owner = server.authenticate(request)
        try:
            sid = server.store.create(owner)
        except SessionLimit:
            raise APIError(
                429,
                f"this key holds {server.config.max_sessions_per_key} sessions; delete some first",
                code="too_many_sessions",
            ) from None
        return JSONResponse(
            {"id": sid, "object": "session", "created": int(time.time())}, headers={SESSION_HEADER: sid}
        )

    @app.delete("/v1/sessions/{sid}")
    async def delete_session(sid: str, request: Request) -> dict[str, Any]:
        owner = server.authenticate(request)
        session = server.store.remove(owner, sid)
        if session is None:
            raise APIError(404, f"unknown session {sid!r}", param="session_id", code="session_not_found")
        server.cancel_running(
            session
        )  # a running request stops at its next step; close() then returns at once
        await server.run_off_loop(session.close)
        return {"id": sid, "object": "session.deleted", "deleted": True}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await complete(request, openai.CHAT, ChatCompletionRequest, openai.chat_messages)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, openai.COMPLETION, CompletionRequest, openai.completion_prompt)

    async def complete(
        request: Request, kind: openai.Kind, schema: Any, prompt_of: Callable[[Any], Any]
    ) -> Response:
        owner = server.authenticate(request)
        req = await read_json(request, schema, server.config.max_body_bytes)
        session = server.resolve_session(request, owner)
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
        reply = openai.Reply(kind, server.model_id, server.logprobs, call.include_usage)
        headers = {}
        if request.headers.get(SESSION_HEADER):
            headers[SESSION_HEADER] = request.headers[SESSION_HEADER].strip()
        if call.stream:
            return streaming.respond(server, session, call, reply, headers)
        handle = server.submit(session, call)
        try:
            result = await _await_handle(request, handle, server)
        except Exception as exc:
            exc = server.outcome(handle, exc)
            if isinstance(exc, Cancelled):
                raise APIError(499, "the request was cancelled", code="cancelled") from None
            raise from_engine_error(exc) from None
        server.record(result)
        entries = (
            server.logprobs.visible(call.recorder.finish(result.tokens), result) if call.recorder else None
        )
        return JSONResponse(reply.body(result, entries), headers=headers)


async def _await_handle(request: Request, handle: Handle, server: Server) -> Result:
    """The request's result; cancels it if the client disconnects (or the handler is cancelled)."""
    fut = asyncio.wrap_future(handle.future)
    try:
        while True:
            done, _ = await asyncio.wait({fut}, timeout=0.25)
            if done:
                return fut.result()
            if await request.is_disconnected():
                handle.cancel()
                server.metrics.cancel()
                fut.add_done_callback(_consume)
                raise APIError(499, "the client disconnected", code="cancelled")
    except asyncio.CancelledError:
        handle.cancel()
        fut.add_done_callback(_consume)
        raise


def _consume(fut: Any) -> None:
    """Retrieve an abandoned future's outcome (asyncio would log an exception nobody retrieved)."""
    if not fut.cancelled():
        fut.exception()
