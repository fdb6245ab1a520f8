"""Server-sent events: one streaming path for chat completions and completions.

    engine thread: Session.submit(on_token=Feed.on_token) ──► loop.call_soon_threadsafe ──► asyncio.Queue
    event loop:    events(...) ◄──────────────────────────────────────────────────────────────────┘
                     Reply.opening()                 chat: the assistant's role; completions: nothing
                     Reply.chunk(piece, entries)     per piece of text, with the logprobs of its tokens
                     Reply.chunk(None, finish)       the finish reason (and the last logprobs)
                     Reply.usage_chunk(result)       with stream_options.include_usage
                     data: [DONE]

With tools (chat), text that may begin a call is held back; once it is a call, the rest of the output is held
and the calls go out in one `tool_calls` delta at the end (with any text around them as content). The request
is queued before the response starts, so a full server is still a plain 429; an error after that is an error
event. A client that goes away cancels the request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from onnxgen.serve.errors import error_body, from_engine_error

if TYPE_CHECKING:
    from onnxgen import Session
    from onnxgen.serve.openai import Call, Reply
    from onnxgen.serve.server import Server


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class Feed:
    """Carries a request's text pieces (and the logprob entries recorded since the last piece) from the
    engine's thread to the event loop, then its finished future. Make it on the event loop."""

    def __init__(self, recorder: Any) -> None:
        self.loop = asyncio.get_running_loop()
        self.items: asyncio.Queue[tuple[str, Any, Any]] = asyncio.Queue()
        self.recorder = recorder
        self.sent = 0  # recorder entries handed on so far

    def on_token(self, piece: str) -> None:  # on the engine's thread
        new = None
        if self.recorder is not None:
            new = self.recorder.entries[self.sent :]
            self.sent += len(new)
        self.loop.call_soon_threadsafe(self.items.put_nowait, ("token", piece, new))

    def watch(self, handle: Any) -> None:
        handle.future.add_done_callback(
            lambda f: self.loop.call_soon_threadsafe(self.items.put_nowait, ("done", f, None))
        )


def respond(
    server: Server, session: Session | None, call: Call, reply: Reply, headers: dict[str, str]
) -> Any:
    """Queue `call` on `session` and answer with its event stream (raises APIError 429 before the response
    starts when the server is full)."""
    from fastapi.responses import StreamingResponse

    feed = Feed(call.recorder)
    handle = server.submit(session, call, feed.on_token)
    feed.watch(handle)
    return StreamingResponse(
        events(server, call, reply, handle, feed),
        media_type="text/event-stream",
        headers={**headers, "Cache-Control": "no-cache"},
    )


async def events(server: Server, call: Call, reply: Reply, handle: Any, feed: Feed) -> AsyncIterator[str]:
    rec, visible = call.recorder, reply.logprobs.visible
    marker = call.tool_marker
    holding = bool(marker)
    held_text, held_entries = "", []
    try:
        for chunk in reply.opening():
            yield sse(chunk)
        while True:
            kind, payload, new = await feed.items.get()
            if kind == "token":
                entries = visible(new) if new is not None else None
                if holding:
                    held_text += payload
                    held_entries += entries or []
                    head = held_text.lstrip()
                    if head.startswith(marker) or marker.startswith(head):
                        continue  # a call, or maybe the start of one
                    holding = False
                    payload, entries = held_text, (held_entries if entries is not None else None)
                yield sse(reply.chunk(payload, None, entries))
                continue
            exc = payload.exception()
            if exc is not None:
                yield sse(error_body(from_engine_error(server.outcome(handle, exc))))
                break
            result = payload.result()
            server.record(result)
            rest = visible(rec.finish(result.tokens), result)[feed.sent :] if rec is not None else None
            if holding and (held_text or result.tool_calls):  # what was held back
                lp = held_entries if rec is not None else None
                if result.tool_calls:
                    yield sse(reply.chunk(result.content or None, None, lp, tool_calls=result.tool_calls))
                else:
                    yield sse(reply.chunk(held_text, None, lp))
            yield sse(reply.chunk(None, result.finish_reason, rest))
            if call.include_usage:
                yield sse(reply.usage_chunk(result))
            break
        yield "data: [DONE]\n\n"
    finally:
        if not handle.future.done():
            handle.cancel()
            server.metrics.cancel()
