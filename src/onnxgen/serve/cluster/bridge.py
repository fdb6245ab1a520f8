"""One HTTP request carried from the ingress to a replica and its response carried back, as ASGI messages.

    ingress:  ASGI scope + body  ──► HttpCall (plain data, with its RouteKey) ──► the router picks a replica
    replica:  run(app, call)  → the replica's own FastAPI app (`create_app`) called in process; every ASGI
              message it sends is yielded back (a streamed response stays streamed)
    ingress:  relay(messages, send) → the client

The replica runs the very routes of `onnxgen serve`: nothing of a route is repeated here. A client that goes
away while a response streams cancels the replica's generator; the app then sees `http.disconnect` and cancels
the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from onnxgen.serve.cluster.keys import MAX_ROUTED_BODY, RouteKey, creates_session, route_key, session_digest
from onnxgen.serve.sessions import SESSION_EXTENSION

REPLICA_HEADER = b"x-onnxgen-replica"  # names the replica that answered (tests, benchmarks, debugging)


@dataclass(frozen=True)
class HttpCall:
    """An HTTP request as plain data (what crosses from the ingress to a replica). `headers` as ASGI has them
    (lowercase names, bytes); `route`: what the router decides by; `session_id`: the id the ingress gives the
    session a POST /v1/sessions makes (so the router binds it where it sends the request)."""

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    client: tuple[str, int] | None = None
    route: RouteKey = field(default_factory=RouteKey)
    session_id: str | None = None


async def read_call(
    scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]], isolate_keyless: bool
) -> HttpCall:
    """The `HttpCall` of an ASGI http `scope` whose body is read from `receive` (at most one byte past
    `MAX_ROUTED_BODY`: the replica answers 413 for that); its path relative to the scope's `root_path` (the
    application's route prefix)."""
    chunks: list[bytes] = []
    size, more = 0, True
    while more and size <= MAX_ROUTED_BODY:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            break
        chunk = msg.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        more = msg.get("more_body", False)
    body = b"".join(chunks)[: MAX_ROUTED_BODY + 1]
    headers = tuple((bytes(k).lower(), bytes(v)) for k, v in scope.get("headers", ()))
    text = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers}
    client = scope.get("client")
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):  # an application under a route prefix: the path includes it
        path = path[len(root) :] or "/"
    sid = secrets.token_hex(16) if creates_session(scope["method"], path) else None
    route = route_key(scope["method"], path, text, body, isolate_keyless=isolate_keyless)
    return HttpCall(
        method=scope["method"],
        path=path,
        query=scope.get("query_string", b""),
        headers=headers,
        body=body,
        client=(client[0], client[1]) if client else None,
        route=RouteKey(session_digest(sid)) if sid else route,
        session_id=sid,
    )


async def run(app: Any, call: HttpCall, replica: str) -> AsyncIterator[dict[str, Any]]:
    """Run `call` through the ASGI `app` in this process, yielding the messages it sends (the response start
    names `replica` in `REPLICA_HEADER`). Closing the generator early disconnects the request."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": call.method,
        "scheme": "http",
        "path": call.path,
        "raw_path": call.path.encode(),
        "query_string": call.query,
        "root_path": "",
        "headers": list(call.headers),
        "client": call.client,
        "server": ("onnxgen-replica", 0),
        "extensions": {SESSION_EXTENSION: call.session_id} if call.session_id else {},
    }
    out: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    gone = asyncio.Event()
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            msg = {**msg, "headers": [*msg.get("headers", []), (REPLICA_HEADER, replica.encode())]}
        await out.put(msg)

    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: out.put_nowait(None))
    try:
        while (msg := await out.get()) is not None:
            yield msg
            if msg["type"] == "http.response.body" and not msg.get("more_body", False):
                break
        await task  # the app's own failure, if any, is the replica's error
    finally:
        gone.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), 5)
            task.cancel()


async def relay(
    messages: AsyncIterator[dict[str, Any]], send: Callable[[dict[str, Any]], Awaitable[None]]
) -> None:
    """Send a replica's response messages to the client as they come."""
    async for msg in messages:
        await send(msg)
