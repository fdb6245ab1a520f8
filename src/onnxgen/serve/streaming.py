"""One response path for the three API families: a request's output as neutral events, rendered by its family.

    engine thread: submit(on_token=Feed.on_token) ──► loop.call_soon_threadsafe ──► asyncio.Queue
    event loop:    events() ◄─────────────────────────────────────────────────────────────┘
                     ToolStream.feed(piece)      text pieces → Text | ToolStart | ToolArgs | ToolEnd
                     family.opening() / event(e) / finish(result, outcome) / error(err)   → SSE strings

`ToolStream` is the one place tool calls are assembled, for streams and whole responses alike: with tools,
the tool grammar makes an output either plain text or calls from its first character (the format's
marker), so a call region is recognised at once, each call's name is announced as soon as it is complete,
and its arguments are streamed as they are generated (fragments of JSON text whose concatenation is the
call's arguments, valid for its schema by the grammar). A call cut short (`max_tokens`) is never content:
the outcome's finish is "length" and only complete calls are reported.

A family renders (`Family` protocol): `openai.Reply` (chat completions, completions), `anthropic.Reply`
(messages), `responses.Reply` (responses). The request is queued before the response starts, so a full
server is still a plain 429; an error after that is the family's error event. A client that goes away
cancels the request.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from onnxgen.errors import APIError

if TYPE_CHECKING:
    from fastapi import Request
    from fastapi.responses import Response

    from onnxgen import Handle, Result, Session
    from onnxgen.serve.server import Caller, Server


def sse(obj: Any, event: str | None = None) -> str:
    """One server-sent event: `data: <json>` (with `event: <name>` first when given)."""
    data = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event}\ndata: {data}\n\n" if event else f"data: {data}\n\n"


# --- events -------------------------------------------------------------------------------------------


@dataclass
class Text:
    text: str
    entries: list[Any] | None = None  # logprob entries of the tokens behind this text (when recorded)


@dataclass
class ToolStart:
    index: int
    id: str
    name: str
    entries: list[Any] | None = None


@dataclass
class ToolArgs:
    index: int
    fragment: str
    entries: list[Any] | None = None


@dataclass
class ToolEnd:
    index: int
    entries: list[Any] | None = None


Event = Text | ToolStart | ToolArgs | ToolEnd


@dataclass(frozen=True)
class FnCall:
    """A complete tool call: `arguments` is its JSON text as generated."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Call:
    """A request validated and prepared, ready to queue: `prepared` is what `Session.submit` / `Model.submit`
    take (the prompt encoded once, grammars compiled), with what the response needs: the logprobs recorder,
    streaming, usage in the stream, the stop strings (Anthropic names the one that matched)."""

    prepared: Any  # onnxgen.Prepared
    recorder: Any = None  # LogprobsRecorder | None
    stream: bool = False
    include_usage: bool = False
    stops: tuple[str, ...] = ()
    prompt_field: str = "messages"  # the request field an error about the prompt names


@dataclass(frozen=True)
class Outcome:
    """What a finished request answers: `content` (None: none), the complete `calls`, and `finish`:
    "stop" (EOS or a stop string), "length" (max_tokens or the context, a call cut short included) or
    "tool_calls" (ended after complete calls)."""

    content: str | None
    calls: tuple[FnCall, ...]
    finish: str


@dataclass
class _Open:
    """A call being generated: its object's nesting level and what is known of it."""

    level: int
    index: int
    id: str
    name: str | None = None
    args: list[str] = field(default_factory=list)  # argument text generated so far
    sent: int = 0  # fragments of `args` already announced
    key: str | None = None  # the member being read
    key_chars: list[str] | None = None  # a key string being read
    value: list[str] | None = None  # the value of "name" being read (raw JSON)
    in_args: bool = False
    args_level: int = 0
    args_done: bool = False
    expect_value: bool = False


class ToolStream:
    """Assembles text and tool calls from a request's output, piece by piece (see the module docstring).

    `marker`: how the model's calls start ("" when the request parses no tools: everything is text). `feed`
    returns the events a piece completes; `outcome(finish)` the whole answer once the request ended.
    Recognises calls as JSON objects `{"name": ..., "arguments" | "parameters": {...}}` in the call region,
    whatever wraps them (hermes tags, a mistral array, llama3's separators)."""

    ARG_KEYS = ("arguments", "parameters")

    def __init__(self, marker: str, id_prefix: str = "call_") -> None:
        self.marker = marker
        self.id_prefix = id_prefix
        self.mode: str | None = (
            None if marker else "text"
        )  # "text" | "calls" once the first character is seen
        self.text: list[str] = []
        self.calls: list[FnCall] = []
        self._stack: list[str] = []
        self._in_str = False
        self._esc = False
        self._open: _Open | None = None
        self._index = 0

    def feed(self, piece: str) -> list[Event]:
        if not piece:
            return []
        if self.mode is None:
            self.mode = "calls" if piece[0] == self.marker[0] else "text"
        if self.mode == "text":
            self.text.append(piece)
            return [Text(piece)]
        out: list[Event] = []
        for ch in piece:
            self._char(ch, out)
        call = self._open
        if call is not None and call.name is not None and call.sent < len(call.args):
            out.append(ToolArgs(call.index, "".join(call.args[call.sent :])))
            call.sent = len(call.args)
        return out

    def _char(self, ch: str, out: list[Event]) -> None:
        call = self._open
        if call is not None and call.in_args:
            call.args.append(ch)
        if self._in_str:
            if call is not None and call.key_chars is not None:
                call.key_chars.append(ch)
            elif call is not None and call.value is not None:
                call.value.append(ch)
            if self._esc:
                self._esc = False
            elif ch == "\\":
                self._esc = True
            elif ch == '"':
                self._in_str = False
                self._string_done(out)
            return
        if ch == '"':
            self._in_str = True
            if call is not None and len(self._stack) == call.level and not call.in_args:
                if call.expect_value:
                    call.expect_value = False
                    if call.key == "name":
                        call.value = ['"']
                    elif call.key in self.ARG_KEYS:  # a string of arguments (not the grammar's layout)
                        self._start_args(call, '"')
                else:
                    call.key_chars = ['"']
            return
        if ch in "[{":
            if call is not None and call.expect_value and len(self._stack) == call.level:
                call.expect_value = False
                if call.key in self.ARG_KEYS:
                    self._start_args(call, ch)
            self._stack.append(ch)
            if ch == "{" and "{" not in self._stack[:-1] and call is None:
                self._open = _Open(len(self._stack), self._index, f"{self.id_prefix}{secrets.token_hex(12)}")
            return
        if ch in "]}":
            if self._stack:
                self._stack.pop()
            if call is not None:
                if call.in_args and len(self._stack) == call.level:
                    self._end_args(call)
                elif len(self._stack) < call.level:  # the call's object closed
                    self._close_call(call, out)
            return
        if call is not None and len(self._stack) == call.level and not call.in_args:
            if ch == ":":
                call.expect_value = True
            elif ch == "," and call.expect_value is False:
                call.key = None

    def _start_args(self, call: _Open, first: str) -> None:
        call.in_args = True
        call.args = [first]
        call.args_level = len(self._stack)

    def _end_args(self, call: _Open) -> None:
        call.in_args = False
        call.args_done = True

    def _string_done(self, out: list[Event]) -> None:
        call = self._open
        if call is None:
            return
        if call.key_chars is not None:
            try:
                call.key = json.loads("".join(call.key_chars))
            except ValueError:
                call.key = None
            call.key_chars = None
        elif call.value is not None:
            try:
                name = json.loads("".join(call.value))
            except ValueError:
                name = None
            call.value = None
            if isinstance(name, str) and call.name is None:
                call.name = name
                out.append(ToolStart(call.index, call.id, name))
        elif call.in_args and len(self._stack) == call.level:  # a string of arguments ended
            self._end_args(call)

    def _close_call(self, call: _Open, out: list[Event]) -> None:
        self._open = None
        if call.name is None or not call.args_done:
            return
        args = "".join(call.args)
        if args.startswith('"'):  # arguments sent as a JSON string holding the JSON text
            try:
                args = json.loads(args)
            except ValueError:
                return
        if call.sent < len(call.args):
            out.append(ToolArgs(call.index, "".join(call.args[call.sent :])))
            call.sent = len(call.args)
        self.calls.append(FnCall(call.id, call.name, args))
        out.append(ToolEnd(call.index))
        self._index += 1

    @property
    def cut(self) -> bool:
        """A call was still being generated when the output ended."""
        return self._open is not None

    def outcome(self, finish: str) -> Outcome:
        """The answer once the request ended with the engine's `finish` ("stop" | "length"): complete calls
        only; content None in the call region; "tool_calls" after complete calls that nothing cut short."""
        content = "".join(self.text) if self.mode == "text" else None
        if self.calls and finish == "stop" and not self.cut:
            finish = "tool_calls"
        return Outcome(content, tuple(self.calls), finish)


def assemble(text: str, marker: str, finish: str, id_prefix: str = "call_") -> Outcome:
    """The outcome of a whole output (`ToolStream` over all of it): what a non-streamed response answers."""
    ts = ToolStream(marker, id_prefix)
    ts.feed(text)
    return ts.outcome(finish)


def engine_finish(result: Result) -> str:
    """The engine's own end of `result`: "length" or "stop" (before tool calls are counted)."""
    return "length" if result.finish_reason == "length" else "stop"


# --- families -----------------------------------------------------------------------------------------


class Family(Protocol):
    """How one API family renders a request's answer. `call_prefix`: how its tool call ids start."""

    call_prefix: str

    def opening(self) -> list[str]:
        """SSE the stream starts with."""
        ...

    def event(self, e: Event) -> list[str]:
        """SSE for one event of the output."""
        ...

    def finish(self, result: Result, outcome: Outcome, entries: Sequence[Any] | None) -> list[str]:
        """SSE closing the stream (`entries`: logprob entries not sent yet)."""
        ...

    def error(self, err: APIError) -> list[str]:
        """SSE for a failure after the stream started."""
        ...

    def body(self, result: Result, outcome: Outcome, entries: Sequence[Any] | None) -> dict[str, Any]:
        """The whole response of a finished request."""
        ...


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


async def events(server: Server, call: Call, family: Family, handle: Any, feed: Feed) -> AsyncIterator[str]:
    """The SSE of one streamed request (see the module docstring)."""
    rec, visible = call.recorder, server.logprobs.visible
    tools = ToolStream(call.prepared.tool_marker, family.call_prefix)
    carried: list[Any] = []  # logprob entries of pieces that produced no event yet
    try:
        for s in family.opening():
            yield s
        while True:
            kind, payload, new = await feed.items.get()
            if kind == "token":
                if new is not None:
                    carried += visible(new)
                evs = tools.feed(payload)
                if evs and rec is not None:
                    evs[-1].entries, carried = carried, []
                for e in evs:
                    for s in family.event(e):
                        yield s
                continue
            exc = payload.exception()
            if exc is not None:
                err = server.failure(handle, exc, call.prompt_field)
                for s in family.error(err):
                    yield s
                break
            result = payload.result()
            server.record(result)
            rest = None
            if rec is not None:
                rest = carried + visible(rec.finish(result.tokens), result)[feed.sent :]
            for s in family.finish(result, tools.outcome(engine_finish(result)), rest):
                yield s
            break
    finally:
        if not handle.future.done():
            handle.cancel()
            server.metrics.cancel()


def stream_response(server: Server, call: Call, family: Family, target: Any, headers: dict[str, str]) -> Any:
    """Queue `call` on `target` (a session, or None: stateless) and answer with its event stream (raises
    APIError 429 before the response starts when the server is full)."""
    from fastapi.responses import StreamingResponse

    feed = Feed(call.recorder)
    handle = server.submit(target, call, feed.on_token)
    feed.watch(handle)
    return StreamingResponse(
        events(server, call, family, handle, feed),
        media_type="text/event-stream",
        headers={**headers, "Cache-Control": "no-cache"},
    )


# --- the one response path ---------------------------------------------------------------------------


async def read_body(server: Server, request: Request, schema: Any) -> Any:
    """The request's body as `schema` (size, time, depth, strict JSON, types; see bodies.py)."""
    cfg = server.config
    from onnxgen.serve.bodies import read_json

    return await read_json(request, schema, cfg.max_body_bytes, cfg.body_timeout_s)


async def respond(
    server: Server,
    request: Request,
    call: Call,
    family: Family,
    target: Session | Caller | None,
    headers: dict[str, str] | None = None,
) -> Response:
    """The one response path of every family: queue `call` on `target` (a session, or stateless for a caller)
    and answer with `family`'s whole body, or its event stream when the call streams."""
    from fastapi.responses import JSONResponse

    from onnxgen.serve.sessions import SESSION_HEADER

    headers = dict(headers or {})
    sid = request.headers.get(SESSION_HEADER)
    if sid:
        headers[SESSION_HEADER] = sid.strip()
    if call.stream:
        return stream_response(server, call, family, target, headers)
    handle = server.submit(target, call)
    try:
        result = await _await_handle(request, handle, server)
    except APIError:
        raise
    except Exception as exc:
        raise server.failure(handle, exc, call.prompt_field) from None
    server.record(result)
    entries = server.logprobs.visible(call.recorder.finish(result.tokens), result) if call.recorder else None
    outcome = assemble(result.text, call.prepared.tool_marker, engine_finish(result), family.call_prefix)
    return JSONResponse(family.body(result, outcome, entries), headers=headers)


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
