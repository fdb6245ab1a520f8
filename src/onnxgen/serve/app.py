"""The OpenAI-compatible HTTP server: `create_app` wires the parts together.

    app = create_app(onnxgen.load(path), ServerConfig(api_keys=("secret",)))
    uvicorn.run(app, host="127.0.0.1", port=8000)      # or: with RunningServer(app) as srv: ... srv.url

    routes.py      the routes, thin: authenticate → read the body (bodies.py) → map → submit → respond
    openai.py      the OpenAI mapping: request → `Session.generate` arguments; result → response bodies
    streaming.py   SSE, one path for chat completions and completions
    server.py      `ServerConfig`; `Server`, the state behind one app (model, sessions, metrics, auth,
                   requests in flight)
    app.py         `create_app`; `RunningServer`

A request is validated and prepared once before it is queued (JSON, schema types, model name; then
`Model.prepare`: the prompt encoded, sampling ranges checked, grammars compiled), submitted to its session
(`Session.submit`) and awaited on the event loop: the model's one loop thread runs every request, batched into
the same engine steps; no thread waits per request. Generation, reuse and sampling live in the engine; this
package uses only the public `Model` / `Session` API.

Sessions: `POST /v1/sessions` returns an id; a request names it in `X-Session-Id`; requests without
one use their API key's default session. Sessions and their KV are scoped to the API key (its salt).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from onnxgen.errors import APIError
from onnxgen.serve.errors import error_body, from_engine_error
from onnxgen.serve.metrics import CountRequests
from onnxgen.serve.routes import add_routes, route_label
from onnxgen.serve.server import Server, ServerConfig
from onnxgen.serve.sessions import SESSION_HEADER

__all__ = ["SESSION_HEADER", "RunningServer", "Server", "ServerConfig", "create_app"]

if TYPE_CHECKING:
    from onnxgen import Model


def create_app(model: Model, config: ServerConfig | None = None) -> Any:
    """A FastAPI app serving `model` (an `onnxgen.Model`). See the module docstring."""
    server = Server(model, config or ServerConfig())
    app = FastAPI(title="onnxgen", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(error_body(err), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        err = from_engine_error(exc)
        return JSONResponse(error_body(err), status_code=err.status)

    app.add_middleware(CountRequests, metrics=server.metrics, label=route_label)
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
            uvicorn.Config(app, log_level=log_level, lifespan="off", access_log=False)
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
