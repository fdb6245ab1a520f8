"""The state behind one server app: its configuration (`ServerConfig`) and `Server` (the model, the session
store, metrics, authentication, tenancy, and the requests in flight, so they can be bounded and cancelled).
Routes and streaming read it; `app.py` builds it.

No thread runs per request: a route submits its prepared request (`Model.submit` for a stateless request,
`Session.submit` for a named session; both return a `Handle` at once) and awaits the handle's future on the
event loop; the model's one loop thread runs every request and calls back through the loop
(`asyncio.wrap_future`, `call_soon_threadsafe`). Nothing here waits on the engine: metrics read
`Model.kv_snapshot`.

Tenancy (what may reuse whose KV; every reuse is by identity, the salt part of it):
- with API keys, each key is a tenant: its requests and sessions are salted with the key's id, and a
  request's `cache_salt` (body field or `X-Cache-Salt` header) narrows that further;
- without keys (one operator's server, loopback by default) every request may reuse any cached prefix, as
  llama.cpp and vLLM do; a request's `cache_salt` isolates it, and `isolate_keyless` makes every unnamed
  keyless request a context of its own (for keyless multi-tenant deployments: reuse is observable through
  timing and `cached_tokens`, a side channel between callers who share a salt).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from onnxgen.errors import APIError, Cancelled, SessionLimit
from onnxgen.serve.errors import from_engine_error
from onnxgen.serve.messages import Fetch, fetch_image
from onnxgen.serve.metrics import Metrics
from onnxgen.serve.openai import Logprobs
from onnxgen.serve.sessions import SESSION_HEADER, SessionStore

if TYPE_CHECKING:
    from onnxgen import Handle, Model, Result, Session
    from onnxgen.serve.streaming import Call

log = logging.getLogger("onnxgen.serve")

SALT_HEADER = "X-Cache-Salt"
MAX_SALT = 256


@dataclass(frozen=True)
class ServerConfig:
    """api_keys: accepted keys (`Authorization: Bearer KEY` or `x-api-key: KEY`; empty: no auth). max_queue:
    requests that may wait beyond those the engine runs at once (`Model.max_running`) before new ones get 429.
    max_body_bytes: larger bodies get 413. model_id: the name clients pass as `model` (default: the package
    folder's name). max_tokens_cap: the most tokens one request may generate (also the default when it names
    none; more is a 400). request_timeout_s: wall time a request may run; past it, it is cancelled and
    answered 504. body_timeout_s: time to receive a request's body (408 past it). max_sessions_per_key:
    sessions one key (or, without keys, everyone) may hold; max_sessions_per_client: without keys, sessions
    one client address may hold; session_ttl_s: idle time after which a session expires. isolate_keyless:
    without keys, unnamed requests share no KV (see the module docstring). metrics_keys: with API keys, the
    keys that may read /metrics (server-wide numbers; none: nobody). max_stored_responses: responses kept for
    `previous_response_id` and GET (least recently stored dropped first). kv_dir: where sessions are saved
    (`POST /v1/sessions/{id}/save`, and all at shutdown) and restored from by id (None: nowhere).
    adopt_sessions: a request naming a well-formed session id this server neither holds nor has a file of
    starts an empty session under that id instead of a 404 (a replica behind a router, where a session may
    move between replicas: its conversation is then recomputed; off for one server).
    allow_remote_images: fetch http(s) image URLs of content parts (at most `max_body_bytes` each); off, only
    data: URLs are accepted."""

    api_keys: tuple[str, ...] = ()
    max_queue: int = 64
    max_body_bytes: int = 8 * 1024 * 1024
    model_id: str | None = None
    retry_after_s: int = 1
    max_sessions_per_key: int = 1024
    max_sessions_per_client: int = 64
    session_ttl_s: float = 3600.0
    aliases: tuple[str, ...] = field(default=())
    max_tokens_cap: int = 2048
    request_timeout_s: float = 600.0
    body_timeout_s: float = 30.0
    isolate_keyless: bool = False
    metrics_keys: tuple[str, ...] = ()
    max_stored_responses: int = 1024
    kv_dir: str | None = None
    adopt_sessions: bool = False
    allow_remote_images: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens_cap < 1:
            raise ValueError(f"max_tokens_cap must be >= 1, got {self.max_tokens_cap}")
        for name in ("request_timeout_s", "body_timeout_s", "session_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class Caller:
    """Who sent a request: `owner` (the key's id, or "anonymous"), `client` (what session creation is counted
    against: the key's id, or the client's address without keys) and the `salt` of its stateless requests
    (None: shared with every unsalted caller; `private`: a context of its own, nothing reused)."""

    owner: str
    client: str
    salt: str | None
    private: bool = False


def _hit_rate(stats: dict[str, Any]) -> float:
    looked = stats.get("prefix_lookup_tokens", 0)
    return stats.get("prefix_hit_tokens", 0) / looked if looked else 0.0


def _key_id(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class Server:
    """The state behind one app (`app.state.server`): model, sessions, metrics; who is calling, which session a
    request runs on, and the requests in flight (bounded, and cancellable by session)."""

    def __init__(self, model: Model, config: ServerConfig) -> None:
        self.model = model
        self.config = config
        self.model_id = config.model_id or model.spec.path.name
        self.model_names = {self.model_id, *config.aliases}
        self.keys = {_key_id(k): k for k in config.api_keys}
        self.metrics_keys = {_key_id(k): k for k in config.metrics_keys}
        self.capacity = model.max_running + config.max_queue  # requests in flight before a 429
        self.store = SessionStore(
            model,
            config.max_sessions_per_key,
            config.max_sessions_per_client,
            config.session_ttl_s,
            kv_dir=config.kv_dir,
        )
        self.logprobs = Logprobs(model)
        # how a content part's remote image URL is fetched (None: refused; `messages.image_part`)
        self.image_fetch: Fetch | None = (
            functools.partial(fetch_image, max_bytes=config.max_body_bytes)
            if config.allow_remote_images
            else None
        )
        self.metrics = Metrics()
        self.created = int(time.time())
        self.responses: Any = None  # the Responses API's store (responses.py sets it)
        self._inflight: dict[int, set[Handle]] = {}  # id(session) -> handles queued or running on it
        self._count = 0
        self._timed_out: set[int] = set()  # ids of handles cancelled for running past the timeout
        self._lock = threading.Lock()
        # request preparation (encoding, grammar compilation) runs off the event loop on these few threads
        self.prepare_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="onnxgen-prepare")
        self._gauges()

    def _gauges(self) -> None:
        m, kv = self.metrics, self.model.kv_snapshot  # NOTE: never waits for the engine's step
        m.gauge(
            "onnxgen_queue_depth",
            "Requests in flight (running or waiting for the engine).",
            lambda: self.depth,
        )
        m.gauge("onnxgen_sessions", "Open sessions.", lambda: len(self.store))
        m.gauge(
            "onnxgen_retained_kv_bytes",
            "Bytes of KV retained by sessions.",
            lambda: kv()["retained_kv_bytes"],
        )
        m.gauge("onnxgen_requests_running", "Requests the engine is running now.", lambda: kv()["running"])
        m.gauge(
            "onnxgen_requests_waiting",
            "Requests waiting for the engine (in a session's queue or the engine's).",
            lambda: max(self.depth - kv()["running"], 0),
        )
        m.gauge(
            "onnxgen_preemptions",
            "Running requests preempted (KV dropped, recomputed) since start.",
            lambda: kv().get("preemptions", 0),
        )
        for key, what in (
            ("saved", "Session files written since start."),
            ("saved_bytes", "Bytes of session files written since start."),
            ("restored", "Session files restored since start."),
            ("restored_bytes", "Bytes of session files restored since start."),
            ("restore_s", "Seconds spent reading and checking restored session files since start."),
        ):
            m.gauge(f"onnxgen_session_files_{key}", what, lambda k=key: kv().get(f"session_files_{k}", 0))
        if "spills" in kv():  # the host and disk tiers of sessions pushed out of memory
            for key, what in (
                ("host_sessions", "Sessions whose KV waits in the host tier now."),
                ("host_bytes", "Bytes of KV in the host tier now."),
                ("spilled_sessions", "Sessions whose KV waits in the disk tier now."),
                ("spilled_bytes", "Bytes of the disk tier's session files now."),
                ("spills", "Sessions spilled to the disk tier since start."),
                ("unspills", "Sessions resumed from the disk tier since start."),
            ):
                m.gauge(f"onnxgen_{key}", what, lambda k=key: kv().get(k, 0))
        if self.model.paged:
            m.gauge("onnxgen_kv_pages_used", "KV pool pages in use.", lambda: kv().get("pages_used", 0))
            m.gauge("onnxgen_kv_pages_free", "KV pool pages free.", lambda: kv().get("pages_free", 0))
            m.gauge(
                "onnxgen_kv_pages_shared",
                "KV pool pages held by more than one request or session.",
                lambda: kv().get("pages_shared", 0),
            )
            m.gauge(
                "onnxgen_prefix_hit_rate",
                "Prompt tokens found in the prefix cache / prompt tokens looked up, since start.",
                lambda: _hit_rate(kv()),
            )
            for key, what in (  # the pool's host tier (kv/tiers.py)
                ("host_pages", "KV pages in the host tier now."),
                ("host_pages_bytes", "Bytes of KV pages in the host tier now."),
                ("host_pages_saved", "KV pages copied to the host tier since start."),
                ("host_pages_restored", "KV pages copied back from the host tier since start."),
            ):
                m.gauge(f"onnxgen_{key}", what, lambda k=key: kv().get(k, 0))
        else:
            m.gauge(
                "onnxgen_stateless_contexts",
                "Contexts of stateless requests retained for reuse (matched by longest prefix).",
                lambda: kv().get("stateless_contexts", 0),
            )

    @property
    def depth(self) -> int:
        """Requests in flight: submitted and not yet finished."""
        return self._count

    # --- who is calling ------------------------------------------------------------------------------

    def _presented_key(self, request: Any) -> str | None:
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
        key = request.headers.get("x-api-key", "").strip()
        return key or None

    def authenticate(self, request: Any) -> str:
        """The caller's key id (sha256 of the key), or "anonymous" when the server has no keys. Raises 401."""
        if not self.keys:
            return "anonymous"
        token = self._presented_key(request)
        if token is not None:
            for known_id, key in self.keys.items():
                if secrets.compare_digest(token.encode(), key.encode()):
                    return known_id
        raise APIError(
            401,
            "missing or invalid API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
            code="invalid_api_key",
        )

    def authorize_metrics(self, request: Any) -> None:
        """/metrics shows every tenant's traffic: with API keys only `metrics_keys` may read it (401/403)."""
        if not self.keys:
            return
        token = self._presented_key(request)
        if token is not None:
            for key in self.metrics_keys.values():
                if secrets.compare_digest(token.encode(), key.encode()):
                    return
        self.authenticate(request)  # 401 for no or an unknown key
        raise APIError(
            403,
            "/metrics shows every tenant's traffic: it needs a metrics key (onnxgen serve --metrics-key)",
            code="forbidden",
        )

    def caller(self, request: Any, body_salt: str | None = None) -> Caller:
        """Who sent `request` and the salt its stateless requests run under (see the module docstring).
        `body_salt`: the request body's `cache_salt` (else the `X-Cache-Salt` header). Raises 401, 400."""
        owner = self.authenticate(request)
        salt = body_salt if body_salt is not None else request.headers.get(SALT_HEADER)
        if salt is not None and not (0 < len(salt) <= MAX_SALT):
            raise APIError(
                400,
                f"cache_salt must be 1 to {MAX_SALT} characters",
                param="cache_salt",
                code="invalid_value",
            )
        if self.keys:
            return Caller(owner, owner, owner if salt is None else f"{owner}|{salt}")
        client = request.client.host if request.client is not None else "unknown"
        if salt is not None:
            return Caller(owner, f"client:{client}", f"salt:{salt}")
        return Caller(owner, f"client:{client}", None, private=self.config.isolate_keyless)

    def session_salt(self, caller: Caller) -> tuple[str | None, bool]:
        """(salt, per-id) of a session `caller` creates: the key's id; without keys none (shared), or the
        session's own id when keyless callers are isolated."""
        if self.keys:
            return caller.owner, False
        return None, self.config.isolate_keyless

    def create_session(self, caller: Caller, sid: str | None = None) -> str:
        """A new session id for `caller` (`sid`: the id an ingress in front of this server chose, passed in
        the ASGI scope, never by a client). Raises APIError 429 at the owner's or client's bound."""
        salt, per_id = self.session_salt(caller)
        try:
            if sid is not None and self.store.adopt(
                caller.owner, caller.client, salt, sid, per_id_salt=per_id
            ):
                return sid
            return self.store.create(caller.owner, caller.client, salt, per_id_salt=per_id)
        except SessionLimit as exc:
            raise APIError(429, str(exc), code="too_many_sessions") from None

    async def resolve_session(self, request: Any, caller: Caller) -> Session | None:
        """The session named by `X-Session-Id` (scoped to the key; with a kv_dir, restored from its file when
        the store does not hold it; with `adopt_sessions`, else begun empty under its id), or None: a
        stateless request."""
        sid = request.headers.get(SESSION_HEADER)
        if sid is None:
            return None
        sid = sid.strip()
        session = self.store.get(caller.owner, sid)
        if session is None and self.store.file(caller.owner, sid) is not None:
            salt, per_id = self.session_salt(caller)
            session = await self.run_off_loop(self.store.restore, caller.owner, sid, sid if per_id else salt)
        if session is None and self.config.adopt_sessions:
            salt, per_id = self.session_salt(caller)
            try:
                session = self.store.adopt(caller.owner, caller.client, salt, sid, per_id_salt=per_id)
            except SessionLimit as exc:
                raise APIError(429, str(exc), code="too_many_sessions") from None
        if session is None:
            raise APIError(
                404,
                f"unknown session {sid!r}: create one with POST /v1/sessions",
                param=SESSION_HEADER,
                code="session_not_found",
            )
        return session

    # --- requests in flight --------------------------------------------------------------------------

    def submit(self, target: Session | Caller | None, call: Call, on_token: Any = None) -> Handle:
        """Queue a prepared request (call from the event loop) on a session, or stateless for a `Caller` (under
        its salt; a private caller reuses nothing). Raises APIError 429 when `capacity` requests are in
        flight, 404 when the session was deleted. While in flight it is registered under its session (so
        `DELETE /v1/sessions/{id}` can cancel it); past `request_timeout_s` it is cancelled (answered 504)."""
        from onnxgen import Session

        prepared = call.prepared
        session = target if isinstance(target, Session) else None
        if session is None:
            caller = target if isinstance(target, Caller) else None
            if caller is not None and caller.private:
                prepared = dataclasses.replace(prepared, reuse=False)
            elif caller is not None:
                prepared = dataclasses.replace(prepared, salt=caller.salt)
        elif session.closed:
            raise APIError(404, "the session was deleted", param=SESSION_HEADER, code="session_not_found")
        with self._lock:
            if self._count >= self.capacity:
                raise APIError(
                    429,
                    f"the server is busy ({self._count} requests in flight); retry later",
                    code="queue_full",
                    headers={"Retry-After": str(self.config.retry_after_s)},
                )
            self._count += 1
        try:
            if session is None:
                handle = self.model.submit(prepared, on_token=on_token)
            else:
                handle = session.submit(prepared, on_token=on_token)
        except BaseException:
            with self._lock:
                self._count -= 1
            raise
        key = id(session) if session is not None else 0
        with self._lock:
            self._inflight.setdefault(key, set()).add(handle)
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.config.request_timeout_s, self._expire, handle)

        def done(_: Any) -> None:  # on the engine's thread
            with self._lock:
                self._count -= 1
                held = self._inflight.get(key)
                if held is not None:
                    held.discard(handle)
                    if not held:
                        del self._inflight[key]
            loop.call_soon_threadsafe(timer.cancel)

        handle.future.add_done_callback(done)
        return handle

    def _expire(self, handle: Handle) -> None:
        with self._lock:
            self._timed_out.add(id(handle))
        handle.cancel()

    def failure(self, handle: Handle, exc: BaseException, prompt_field: str = "messages") -> APIError:
        """What a failed request answers: 504 for a request this server cancelled for running too long, 499
        for another cancellation, else the engine's error mapped (bad input 400; 5xx logged)."""
        with self._lock:
            timed_out = id(handle) in self._timed_out
            self._timed_out.discard(id(handle))
        if isinstance(exc, Cancelled):
            if timed_out:
                timeout = self.config.request_timeout_s
                return APIError(
                    504,
                    f"the request ran longer than this server's limit of {timeout:g} s and was cancelled; ask "
                    "for fewer tokens",
                    code="timeout",
                )
            return APIError(499, "the request was cancelled", code="cancelled")
        err = from_engine_error(exc, prompt_field=prompt_field)
        if err.status >= 500:
            log.error("a request failed: %s", err.message, exc_info=exc)
        return err

    def cancel_running(self, session: Session) -> bool:
        """Cancel the requests queued or running on `session` (they stop at their next step); True if any."""
        with self._lock:
            handles = list(self._inflight.get(id(session), ()))
        for h in handles:
            h.cancel()
        return bool(handles)

    async def close_expired(self) -> None:
        """Close the sessions that expired (their requests cancelled, their KV freed), off the event loop."""
        for session in self.store.expired():
            self.cancel_running(session)
            await self.run_off_loop(session.close)

    def record(self, result: Result) -> None:
        """Count a finished generation in the metrics."""
        s = result.stats
        self.metrics.generation(s.prompt_tokens, s.generated_tokens, s.reused_tokens, s.ttft_s)

    async def run_off_loop(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` on the preparation threads (work that would block the event loop)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.prepare_pool, lambda: fn(*args, **kwargs))

    def close(self) -> None:
        """Save the sessions (with a kv_dir) and stop the preparation threads (requests end with the model's
        loop)."""
        if self.store.kv_dir is not None:
            n = self.store.save_all()
            log.info("saved %d session(s) to %s", n, self.store.kv_dir)
        self.prepare_pool.shutdown(wait=False, cancel_futures=True)
