"""The HTTP server: `create_app` wires the parts together.

    app = create_app(onnxgen.load(path), ServerConfig(api_keys=("secret",)))
    uvicorn.run(app, host="127.0.0.1", port=8000, **UVICORN_OPTIONS)   # or: with RunningServer(app) as srv: ...

    routes.py      the routes, thin: authenticate → read the body (bodies.py) → map → `respond`
    openai.py      OpenAI chat completions and completions; the preparation every family ends in
    anthropic.py   Anthropic Messages (`/v1/messages`, `/v1/messages/count_tokens`)
    responses.py   OpenAI Responses (`/v1/responses`, stored responses, `previous_response_id`)
    streaming.py   one response path for all three: tool calls assembled as generated, SSE per family
    server.py      `ServerConfig`; `Server`, the state behind one app (model, sessions, metrics, auth,
                   tenancy, requests in flight)
    app.py         `create_app`; `RunningServer`

A request is validated and prepared once before it is queued (JSON, schema types, model name; then
`Model.prepare`: the prompt encoded, sampling ranges checked, grammars compiled), submitted stateless
(`Model.submit`) or to its session (`Session.submit`) and awaited on the event loop: the model's one loop
thread runs every request, batched into the same engine steps; no thread waits per request. Generation, reuse
and sampling live in the engine; this package uses only the public `Model` / `Session` API.

Every error is a JSON body in the family's shape with its status: 4xx for what the request got wrong (404/405
for unknown routes and methods, never a redirect; 431 for headers over `MAX_HEADER_BYTES`), 5xx only for
the server's own failures, each logged with its traceback.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from onnxgen.errors import APIError
from onnxgen.serve.errors import body_for, from_engine_error
from onnxgen.serve.metrics import CountRequests
from onnxgen.serve.routes import add_routes, route_label
from onnxgen.serve.server import Server, ServerConfig
from onnxgen.serve.sessions import SESSION_HEADER

__all__ = ["SESSION_HEADER", "UVICORN_OPTIONS", "RunningServer", "Server", "ServerConfig", "create_app"]

if TYPE_CHECKING:
    from onnxgen import Model

log = logging.getLogger("onnxgen.serve")

MAX_HEADER_BYTES = 64 * 1024  # request headers together; more is a 431
# NOTE: h11 must read headers past MAX_HEADER_BYTES for the app to answer 431 (past this it answers 400 itself)
UVICORN_OPTIONS: dict[str, Any] = {"h11_max_incomplete_event_size": 1024 * 1024, "http": "h11"}


class LimitHeaders:
    """Pure ASGI middleware: a request whose headers total more than `limit` bytes gets 431."""

    def __init__(self, app: Any, limit: int = MAX_HEADER_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            size = sum(len(k) + len(v) for k, v in scope.get("headers", ()))
            if size > self.limit:
                err = APIError(
                    431, f"the request headers total {size} bytes; at most {self.limit} are accepted"
                )
                resp = JSONResponse(
                    body_for(scope.get("path", ""), err), status_code=431, headers={"Connection": "close"}
                )
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(model: Model, config: ServerConfig | None = None) -> Any:
    """A FastAPI app serving `model` (an `onnxgen.Model`). See the module docstring."""
    server = Server(model, config or ServerConfig())
    app = FastAPI(title="onnxgen", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status >= 500:
            log.error("%s %s: %s", request.method, request.url.path, exc.message, exc_info=exc.__cause__)
        return JSONResponse(body_for(request.url.path, exc), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        err = APIError(exc.status_code, str(exc.detail), code=code)
        return JSONResponse(body_for(request.url.path, err), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        err = from_engine_error(exc)
        if err.status >= 500:
            log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return JSONResponse(body_for(request.url.path, err), status_code=err.status)

    app.add_middleware(CountRequests, metrics=server.metrics, label=route_label)
    app.add_middleware(LimitHeaders)
    add_routes(app, server)
    return app


class RunningServer:
    """A uvicorn server on a thread (tests, benchmarks, notebooks). `url` is its base URL.

    Binds `host:port` itself (port 0: a free port), so there is no race for the port.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.app = app
        self.server = uvicorn.Server(
            uvicorn.Config(app, log_level=log_level, lifespan="off", access_log=False, **UVICORN_OPTIONS)
        )
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()
        state = getattr(self.app.state, "server", None)
        if state is not None:
            state.close()

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
