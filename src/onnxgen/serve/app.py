"""The OpenAI-compatible HTTP app: routes, auth, request → engine mapping, SSE streaming.

    app = create_app(onnxgen.load(path), ServerConfig(api_keys=("secret",)))
    uvicorn.run(app, host="127.0.0.1", port=8000)

This module (FastAPI, imported only by the server) owns HTTP only. A request is validated here (JSON, schema types, model name, sampling
ranges through the engine's `SamplingParams`, prompt length through `Model.encode_prompt`), turned
into token ids + keyword arguments for `Session.generate`, and handed to the model's single
`EngineWorker`, which runs requests in order. Generation, reuse and sampling live in the engine.

Sessions: `POST /v1/sessions` returns an id; a request names it in `X-Session-Id`; requests without
one use their API key's default session. Sessions and their KV are scoped to the API key.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from onnxgen.errors import APIError, Cancelled, GrammarError, InvalidRequest, QueueFull, SessionLimit
from onnxgen.serve.bodies import parse_json_body
from onnxgen.serve.errors import error_body, from_engine_error
from onnxgen.serve.metrics import Metrics
from onnxgen.serve.schemas import ChatCompletionRequest, CompletionRequest
from onnxgen.serve.sessions import SessionStore
from onnxgen.serve.worker import EngineWorker

SESSION_HEADER = "X-Session-Id"
ROUTES = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/sessions")


@dataclass(frozen=True)
class ServerConfig:
    """api_keys: accepted bearer keys (empty: no auth). max_queue: requests that may wait for the
    engine worker before new ones get 429. max_body_bytes: larger bodies get 413. model_id: the
    name clients pass as `model` (default: the package folder's name). max_tokens_cap: the most tokens
    one request may generate (also the default when it names none; more is a 400).
    request_timeout_s: wall time a request may run; past it, it is cancelled and answered 504."""

    api_keys: tuple[str, ...] = ()
    max_queue: int = 64
    max_body_bytes: int = 8 * 1024 * 1024
    model_id: str | None = None
    retry_after_s: int = 1
    max_sessions_per_key: int = 1024
    aliases: tuple[str, ...] = field(default=())
    max_tokens_cap: int = 2048
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_tokens_cap < 1:
            raise ValueError(f"max_tokens_cap must be >= 1, got {self.max_tokens_cap}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")


@dataclass
class _Prepared:
    ids: list[int]  # the prompt encoded on its own (validation; the engine re-encodes chat prompts against
    prompt: Any  # the session's cache, keeping the ids it generated: `Engine.encode_prompt(held=...)`)
    kwargs: dict[str, Any]
    session: Any
    recorder: Any
    stream: bool
    include_usage: bool


def _key_id(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class _Server:
    """State behind one app: model, worker, sessions, metrics."""

    def __init__(self, model: Any, config: ServerConfig) -> None:
        self.model = model
        self.config = config
        self.model_id = config.model_id or model.spec.path.name
        self.model_names = {self.model_id, *config.aliases}
        self.keys = {_key_id(k): k for k in config.api_keys}
        self.worker = EngineWorker(config.max_queue)
        self.store = SessionStore(model, config.max_sessions_per_key)
        self.metrics = Metrics()
        self.metrics.gauge("onnxgen_queue_depth", "Requests waiting for or running on the engine worker.",
                           lambda: self.worker.depth)  # fmt: skip
        self.metrics.gauge("onnxgen_sessions", "Open sessions (including per-key default sessions).", lambda: len(self.store))
        self.metrics.gauge("onnxgen_retained_kv_bytes", "Bytes of KV retained by sessions.",
                           lambda: model.registry.total_kv_bytes())  # fmt: skip
        self.created = int(time.time())
        self._grammar: Any = None
        self._grammar_lock = threading.Lock()
        self._running: dict[int, threading.Event] = {}  # id(session) -> cancel event of its running request
        self._running_lock = threading.Lock()

    def cancel_running(self, session: Any) -> bool:
        """Cancel the request running on `session` (it stops at its next step); True if there was one."""
        with self._running_lock:
            cancel = self._running.get(id(session))
        if cancel is not None:
            cancel.set()
        return cancel is not None

    # --- auth & body ---------------------------------------------------------------------

    def authenticate(self, request: Any) -> str:
        """The caller's key id (sha256 of the key), or "anonymous" when the server has no keys."""
        if not self.keys:
            return "anonymous"
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        token = token.strip()
        if scheme.lower() == "bearer" and token:
            for known_id, key in self.keys.items():
                if secrets.compare_digest(token.encode(), key.encode()):
                    return known_id
        raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    async def read_json(self, request: Any, schema: Any) -> Any:
        from pydantic import ValidationError

        limit = self.config.max_body_bytes
        cl = request.headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        chunks: list[bytes] = []
        n = 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
            chunks.append(chunk)
        data = parse_json_body(b"".join(chunks))
        try:
            return schema.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = [str(p) for p in err.get("loc", ())]
            param = ".".join(loc) or None
            raise APIError(400, f"{param or 'body'}: {err.get('msg')}", param=param, code="invalid_value") from None

    # --- request preparation -------------------------------------------------------------

    def grammar(self) -> Any:
        with self._grammar_lock:
            if self._grammar is None:
                from onnxgen.sampling.grammar import GrammarCompiler

                self._grammar = GrammarCompiler.for_model(self.model)
            return self._grammar

    def resolve_session(self, request: Any, owner: str) -> Any:
        """The session a request runs on: the one named by `X-Session-Id` (scoped to the key), else the
        key's default session. Without API keys nobody is known, so a request that names no session is its
        own context: None (it runs with `reuse=False` on a throwaway session and shares no KV)."""
        sid = request.headers.get(SESSION_HEADER)
        if sid is None:
            return self.store.default(owner) if self.keys else None
        session = self.store.get(owner, sid.strip())
        if session is None:
            raise APIError(404, f"unknown session {sid!r}: create one with POST /v1/sessions",
                           param=SESSION_HEADER, code="session_not_found")  # fmt: skip
        return session

    def prepare(self, req: Any, ids: list[int], session: Any, *, chat: bool, prompt_field: str,
                prompt: Any = None) -> _Prepared:  # fmt: skip
        """Validate everything that can be validated before queueing (so errors are 400s, also
        for streams) and build `Session.generate` keyword arguments."""
        from onnxgen.sampling import SamplingParams
        from onnxgen.sampling.processors import LogitBias, LogprobsRecorder

        if req.model not in self.model_names:
            raise APIError(400, f"unknown model {req.model!r}; this server serves {self.model_id!r}",
                           param="model", code="model_not_found")  # fmt: skip
        if req.n not in (None, 1):
            raise APIError(400, "only n=1 is supported", param="n", code="invalid_value")
        ctx = self.model.spec.context_length
        max_field = "max_tokens"
        max_tokens = req.max_tokens
        if chat and req.max_completion_tokens is not None:
            max_field, max_tokens = "max_completion_tokens", req.max_completion_tokens
        cap = self.config.max_tokens_cap
        if max_tokens is not None:
            if max_tokens < 1:
                raise APIError(400, f"{max_field} must be >= 1, got {max_tokens}", param=max_field, code="invalid_value")
            if max_tokens > cap:
                raise APIError(400, f"{max_field} is {max_tokens}, above this server's cap of {cap} tokens per "
                               f"request; ask for at most {cap}", param=max_field, code="invalid_value")  # fmt: skip
            if len(ids) + max_tokens > ctx:
                raise APIError(
                    400,
                    f"the prompt ({len(ids)} tokens) plus {max_field} ({max_tokens}) exceeds the model's context "
                    f"length ({ctx}); lower {max_field} to at most {ctx - len(ids)} or shorten the prompt",
                    param=max_field, code="context_length_exceeded",
                )  # fmt: skip
        else:
            max_tokens = min(cap, ctx - len(ids))
        stop = req.stop
        if isinstance(stop, list) and (len(stop) > 16 or not all(stop)):
            raise APIError(400, "stop must be at most 16 non-empty strings", param="stop", code="invalid_value")
        if stop == "":
            stop = None
        sampling = {
            "temperature": req.temperature, "top_k": req.top_k, "top_p": req.top_p, "min_p": req.min_p,
            "repetition_penalty": req.repetition_penalty, "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty, "seed": req.seed,
        }  # fmt: skip
        if req.top_k is not None and req.top_k < 0:
            raise APIError(400, f"top_k must be >= 0, got {req.top_k}", param="top_k", code="invalid_value")
        try:
            SamplingParams.resolve(self.model.spec.search, **sampling)
        except InvalidRequest as exc:
            raise from_engine_error(exc, prompt_field=prompt_field) from None
        processors: list[Any] = []
        recorder = None
        tool_kwargs: dict[str, Any] = {}
        if chat:
            if req.tools or req.tool_choice is not None:
                try:  # validates tools and tool_choice, builds the constraint once here (errors are 400s)
                    self.model.tool_processor(req.tools, req.tool_choice, req.parallel_tool_calls is not False)
                except (InvalidRequest, GrammarError) as exc:
                    raise from_engine_error(exc, prompt_field=prompt_field) from None
                tool_kwargs = {"tools": req.tools, "tool_choice": req.tool_choice,
                               "parallel_tool_calls": req.parallel_tool_calls is not False}  # fmt: skip
            if req.top_logprobs is not None and not req.logprobs:
                raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value")
            if req.logprobs:
                top = req.top_logprobs or 0
                if not 0 <= top <= 20:
                    raise APIError(400, f"top_logprobs must be in [0, 20], got {top}", param="top_logprobs",
                                   code="invalid_value")  # fmt: skip
                recorder = LogprobsRecorder(top)
        else:
            if req.echo:
                raise APIError(400, "echo is not supported", param="echo", code="unsupported")
            if req.suffix:
                raise APIError(400, "suffix is not supported", param="suffix", code="unsupported")
            if req.best_of not in (None, 1):
                raise APIError(400, "only best_of=1 is supported", param="best_of", code="invalid_value")
            if req.logprobs is not None:
                if not 0 <= req.logprobs <= 5:
                    raise APIError(400, f"logprobs must be in [0, 5], got {req.logprobs}", param="logprobs",
                                   code="invalid_value")  # fmt: skip
                recorder = LogprobsRecorder(req.logprobs)
        if recorder is not None:
            processors.append(recorder)
        if req.logit_bias:
            try:
                processors.append(LogitBias({int(k): v for k, v in req.logit_bias.items()}, self.model.spec.vocab_size))
            except ValueError as exc:
                raise APIError(400, f"logit_bias: {exc}", param="logit_bias", code="invalid_value") from None
        rf = req.response_format
        if rf is not None and rf.type != "text":
            processors.append(self.grammar_processor(rf))
        stream = bool(req.stream)
        if req.stream_options is not None and not stream:
            raise APIError(400, "stream_options needs stream=true", param="stream_options", code="invalid_value")
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        kwargs = {"max_new_tokens": max_tokens, "stop": stop, "processors": processors, **sampling, **tool_kwargs}
        return _Prepared(ids, prompt if chat else ids, kwargs, session, recorder, stream, include_usage)

    def grammar_processor(self, rf: Any) -> Any:
        try:
            compiler = self.grammar()
            if rf.type == "json_object":
                return compiler.processor("json_object")
            if rf.type == "json_schema":
                if rf.json_schema is None:
                    raise APIError(400, "response_format.json_schema is required for type json_schema",
                                   param="response_format.json_schema", code="invalid_value")  # fmt: skip
                return compiler.processor("json_schema", rf.json_schema.schema_)
            if rf.type == "regex":
                return compiler.processor("regex", rf.regex)
            return compiler.processor("lark", rf.grammar)
        except GrammarError as exc:
            raise APIError(400, str(exc), param="response_format", code="invalid_response_format") from None

    # --- running -------------------------------------------------------------------------

    def submit(self, prep: _Prepared, on_token: Any = None) -> Any:
        """Queue a prepared request on the engine worker. While it runs it is registered under its session
        (so `DELETE /v1/sessions/{id}` can cancel it) and a timer cancels it after `request_timeout_s`
        (answered 504)."""
        session = prep.session
        timeout = self.config.request_timeout_s

        def run(cancel: threading.Event) -> Any:
            target, extra = session, {}
            if target is None:  # keyless and unnamed: its own context, nothing retained
                target, extra = self.model.session(name="anonymous"), {"reuse": False}
            elif target.closed:
                raise APIError(404, "the session was deleted", param=SESSION_HEADER, code="session_not_found")
            timed_out = threading.Event()

            def expire() -> None:
                timed_out.set()
                cancel.set()

            timer = threading.Timer(timeout, expire)
            timer.daemon = True
            with self._running_lock:
                self._running[id(target)] = cancel
            timer.start()
            try:
                return target.generate(prep.prompt, cancel=cancel, on_token=on_token, **prep.kwargs, **extra)
            except Cancelled:
                if timed_out.is_set():
                    raise APIError(504, f"the request ran longer than this server's limit of {timeout:g} s and was "
                                   "cancelled; ask for fewer tokens", code="timeout") from None  # fmt: skip
                raise
            finally:
                timer.cancel()
                with self._running_lock:
                    self._running.pop(id(target), None)

        try:
            return self.worker.submit(run)
        except QueueFull:
            raise APIError(
                429, f"the server is busy ({self.config.max_queue} requests waiting); retry later",
                code="queue_full", headers={"Retry-After": str(self.config.retry_after_s)},
            ) from None  # fmt: skip

    @staticmethod
    def message(result: Any) -> dict[str, Any]:
        """The assistant message of a chat result: its content and, if it called tools, the calls."""
        msg: dict[str, Any] = {"role": "assistant", "content": result.content}
        if result.tool_calls:
            msg["tool_calls"] = [c.openai() for c in result.tool_calls]
        return msg

    def record(self, result: Any) -> None:
        s = result.stats
        self.metrics.generation(s.prompt_tokens, s.generated_tokens, s.reused_tokens, s.ttft_s)

    @staticmethod
    def usage(result: Any) -> dict[str, Any]:
        s = result.stats
        n = len(result.tokens)
        return {
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": n,
            "total_tokens": s.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": s.reused_tokens},
        }

    def token_text(self, tok: int) -> str:
        return self.model.tokenizer.decode([tok])

    def visible_entries(self, entries: Sequence[Any], result: Any | None) -> list[Any]:
        """Logprob entries of the tokens that produced text (drops a final EOS)."""
        if result is not None and result.tokens and result.tokens[-1] in self.model.eos_token_ids:
            return list(entries[: len(result.tokens) - 1])
        return [e for e in entries if e.token not in self.model.eos_token_ids]

    def chat_logprobs(self, entries: Sequence[Any]) -> dict[str, Any]:
        def item(tok: int, lp: float) -> dict[str, Any]:
            # `token` is text (a partial UTF-8 sequence decodes to U+FFFD); `bytes` are the token's own
            # bytes, so the bytes of consecutive tokens rebuild multi-byte characters
            return {"token": self.token_text(tok), "logprob": lp, "bytes": list(self.model.tokenizer.token_bytes(tok))}

        return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                            for e in entries]}  # fmt: skip

    def completion_logprobs(self, entries: Sequence[Any], offset: int = 0) -> dict[str, Any]:
        tokens, lps, tops, offsets = [], [], [], []
        for e in entries:
            text = self.token_text(e.token)
            tokens.append(text)
            lps.append(e.logprob)
            tops.append({self.token_text(t): lp for t, lp in e.top})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def close(self) -> None:
        self.worker.close(timeout=1.0)


async def _await_job(request: Any, job: Any, server: _Server) -> Any:
    """The job's result; cancels it if the client disconnects (or the handler is cancelled)."""
    fut = asyncio.wrap_future(job.future)
    try:
        while True:
            done, _ = await asyncio.wait({fut}, timeout=0.25)
            if done:
                return fut.result()
            if await request.is_disconnected():
                job.cancel.set()
                server.metrics.cancel()
                fut.add_done_callback(_consume)
                raise APIError(499, "the client disconnected", code="cancelled")
    except asyncio.CancelledError:
        job.cancel.set()
        fut.add_done_callback(_consume)
        raise


def _consume(fut: Any) -> None:
    if not fut.cancelled():
        fut.exception()


def _flatten_content(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise APIError(400, f"content parts of type {part.type!r} are not supported (text only)",
                           param=f"messages.{i}.content", code="unsupported")  # fmt: skip
        parts.append(part.text)
    return "\n".join(parts)


def create_app(model: Any, config: ServerConfig | None = None) -> Any:
    """A FastAPI app serving `model` (an `onnxgen.Model`). See the module docstring."""
    server = _Server(model, config or ServerConfig())
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

    app.add_middleware(_CountRequests, metrics=server.metrics)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": server.model_id, "queue_depth": server.worker.depth}

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        server.authenticate(request)
        return PlainTextResponse(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        server.authenticate(request)
        return {"object": "list", "data": [
            {"id": server.model_id, "object": "model", "created": server.created, "owned_by": "onnxgen"}
        ]}  # fmt: skip

    @app.get("/v1/models/{model_name:path}")
    async def model_info(model_name: str, request: Request) -> dict[str, Any]:
        server.authenticate(request)
        if model_name not in server.model_names:
            raise APIError(404, f"unknown model {model_name!r}; this server serves {server.model_id!r}",
                           param="model", code="model_not_found")  # fmt: skip
        return {"id": model_name, "object": "model", "created": server.created, "owned_by": "onnxgen"}

    @app.post("/v1/sessions")
    async def create_session(request: Request) -> JSONResponse:
        owner = server.authenticate(request)
        try:
            sid = server.store.create(owner)
        except SessionLimit:
            raise APIError(429, f"this key holds {server.config.max_sessions_per_key} sessions; delete some first",
                           code="too_many_sessions") from None  # fmt: skip
        return JSONResponse({"id": sid, "object": "session", "created": int(time.time())},
                            headers={SESSION_HEADER: sid})  # fmt: skip

    @app.delete("/v1/sessions/{sid}")
    async def delete_session(sid: str, request: Request) -> dict[str, Any]:
        owner = server.authenticate(request)
        session = server.store.remove(owner, sid)
        if session is None:
            raise APIError(404, f"unknown session {sid!r}", param="session_id", code="session_not_found")
        server.cancel_running(session)  # a running request stops at its next step; close() then returns at once
        await run_in_threadpool(session.close)
        return {"id": sid, "object": "session.deleted", "deleted": True}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        owner = server.authenticate(request)
        req = await server.read_json(request, ChatCompletionRequest)
        session = server.resolve_session(request, owner)
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
        return await _encode_and_respond(request, req, session, messages, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        owner = server.authenticate(request)
        req = await server.read_json(request, CompletionRequest)
        session = server.resolve_session(request, owner)
        prompt: Any = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt", code="invalid_value")
            prompt = prompt[0]
        return await _encode_and_respond(request, req, session, prompt, chat=False)

    async def _encode_and_respond(request: Request, req: Any, session: Any, prompt: Any, *, chat: bool) -> Response:
        field = "messages" if chat else "prompt"

        def encode_and_prepare() -> _Prepared:  # off the event loop: a long prompt takes milliseconds
            try:
                ids = model.encode_prompt(prompt, tools=req.tools if chat else None)
            except Exception as exc:
                raise from_engine_error(exc, prompt_field=field) from None
            return server.prepare(req, ids, session, chat=chat, prompt_field=field, prompt=prompt)

        prep = await run_in_threadpool(encode_and_prepare)
        return await _respond(request, prep, chat=chat)

    async def _respond(request: Request, prep: _Prepared, *, chat: bool) -> Response:
        headers = {}
        if request.headers.get(SESSION_HEADER):
            headers[SESSION_HEADER] = request.headers[SESSION_HEADER].strip()
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        created = int(time.time())
        if prep.stream:
            # Queue the job before the response starts, so a full queue is still a plain 429.
            loop = asyncio.get_running_loop()
            items: asyncio.Queue[tuple[str, Any, Any]] = asyncio.Queue()
            rec = prep.recorder
            sent = [0]

            def on_token(piece: str) -> None:  # on the worker thread
                new = None
                if rec is not None:
                    new = rec.entries[sent[0] :]
                    sent[0] += len(new)
                loop.call_soon_threadsafe(items.put_nowait, ("token", piece, new))

            job = server.submit(prep, on_token)
            job.future.add_done_callback(lambda f: loop.call_soon_threadsafe(items.put_nowait, ("done", f, None)))
            gen = _stream(prep, job, items, sent, chat=chat, rid=rid, created=created)
            return StreamingResponse(gen, media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"})
        job = server.submit(prep)
        try:
            result = await _await_job(request, job, server)
        except Cancelled:
            raise APIError(499, "the request was cancelled", code="cancelled") from None
        except Exception as exc:
            raise from_engine_error(exc) from None
        server.record(result)
        entries = server.visible_entries(prep.recorder.finish(result.tokens), result) if prep.recorder else None
        if chat:
            body = {
                "id": rid, "object": "chat.completion", "created": created, "model": server.model_id,
                "system_fingerprint": None,
                "choices": [{
                    "index": 0, "message": server.message(result),
                    "logprobs": server.chat_logprobs(entries) if entries is not None else None,
                    "finish_reason": result.finish_reason,
                }],
                "usage": server.usage(result),
            }  # fmt: skip
        else:
            body = {
                "id": rid, "object": "text_completion", "created": created, "model": server.model_id,
                "system_fingerprint": None,
                "choices": [{
                    "index": 0, "text": result.text,
                    "logprobs": server.completion_logprobs(entries) if entries is not None else None,
                    "finish_reason": result.finish_reason,
                }],
                "usage": server.usage(result),
            }  # fmt: skip
        return JSONResponse(body, headers=headers)

    def _sse(obj: Any) -> str:
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

    async def _stream(
        prep: _Prepared, job: Any, items: asyncio.Queue[tuple[str, Any, Any]], sent: list[int],
        *, chat: bool, rid: str, created: int,
    ) -> AsyncIterator[str]:  # fmt: skip
        rec = prep.recorder
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": rid, "object": obj, "created": created, "model": server.model_id, "system_fingerprint": None}
        usage_null = {"usage": None} if prep.include_usage else {}
        text_offset = 0

        def choice(piece: str | None, finish: str | None, entries: list[Any] | None) -> dict[str, Any]:
            nonlocal text_offset
            if chat:
                delta = {} if piece is None else {"content": piece}
                lp = server.chat_logprobs(entries) if entries is not None else None
                return {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
            lp = server.completion_logprobs(entries, text_offset) if entries is not None else None
            text_offset += len(piece or "")
            return {"index": 0, "text": piece or "", "logprobs": lp, "finish_reason": finish}

        # With tools, text that may be the start of a call is held back; once it is a call, the rest of the
        # output is held and sent at the end as `tool_calls` (with any text around them as content).
        marker = model.tool_format.marker if chat and prep.kwargs.get("tools") and prep.kwargs.get("tool_choice") != "none" else ""
        holding = bool(marker)
        held_text, held_entries = "", []

        try:
            if chat:
                yield _sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}], **usage_null})  # fmt: skip
            while True:
                kind, payload, new = await items.get()
                if kind == "token":
                    entries = server.visible_entries(new, None) if new is not None else None
                    if holding:
                        held_text += payload
                        held_entries += entries or []
                        head = held_text.lstrip()
                        if head.startswith(marker) or marker.startswith(head):
                            continue  # a call, or maybe the start of one
                        holding = False
                        payload, entries = held_text, (held_entries if entries is not None else None)
                    yield _sse({**base, "choices": [choice(payload, None, entries)], **usage_null})
                    continue
                exc = payload.exception()
                if exc is not None:
                    err = from_engine_error(exc)
                    yield _sse(error_body(err))
                    break
                result = payload.result()
                server.record(result)
                rest = None
                if rec is not None:
                    rest = server.visible_entries(rec.finish(result.tokens), result)[sent[0] :]
                if holding and (held_text or result.tool_calls):  # what was held back
                    lp = held_entries if rec is not None else None
                    if result.tool_calls:
                        delta: dict[str, Any] = {"tool_calls": [{"index": i, **c.openai()}
                                                                for i, c in enumerate(result.tool_calls)]}  # fmt: skip
                        if result.content:
                            delta = {"content": result.content, **delta}
                        yield _sse({**base, "choices": [{"index": 0, "delta": delta,
                                                         "logprobs": server.chat_logprobs(lp) if lp is not None else None,
                                                         "finish_reason": None}], **usage_null})  # fmt: skip
                    else:
                        yield _sse({**base, "choices": [choice(held_text, None, lp)], **usage_null})
                yield _sse({**base, "choices": [choice(None, result.finish_reason, rest)], **usage_null})
                if prep.include_usage:
                    yield _sse({**base, "choices": [], "usage": server.usage(result)})
                break
            yield "data: [DONE]\n\n"
        finally:
            if not job.future.done():
                job.cancel.set()
                server.metrics.cancel()
                job.future.add_done_callback(_consume)

    return app


class _CountRequests:
    """Pure ASGI middleware counting responses by route and status (streams stay unbuffered)."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in ROUTES else ("/v1/sessions/{id}" if path.startswith("/v1/sessions/") else "other")
        status = [500]

        async def send_wrapper(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.request(route, status[0])


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
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off", access_log=False))
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
