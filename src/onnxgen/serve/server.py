"""The state behind one server app: its configuration (`ServerConfig`) and `Server` (the model, the session
store, metrics, authentication, and the requests in flight, so they can be bounded and cancelled). Routes and
streaming read it; `app.py` builds it.

No thread runs per request: a route submits its prepared request to a session (`Session.submit`, which returns
a `Handle` at once) and awaits the handle's future on the event loop; the model's one loop thread runs every
request and calls back through the loop (`asyncio.wrap_future`, `call_soon_threadsafe`)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from onnxgen.errors import APIError, Cancelled
from onnxgen.serve.metrics import Metrics
from onnxgen.serve.openai import Call, Logprobs
from onnxgen.serve.sessions import SESSION_HEADER, SessionStore

if TYPE_CHECKING:
    from onnxgen import Handle, Model, Result, Session


@dataclass(frozen=True)
class ServerConfig:
    """api_keys: accepted bearer keys (empty: no auth). max_queue: requests that may wait beyond those the
    engine runs at once (`Model.max_running`) before new ones get 429. max_body_bytes: larger bodies get 413. model_id: the
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
        self.capacity = model.max_running + config.max_queue  # requests in flight before a 429
        self.store = SessionStore(model, config.max_sessions_per_key, keyed=bool(config.api_keys))
        self.logprobs = Logprobs(model)
        self.metrics = Metrics()
        self.created = int(time.time())
        self._inflight: dict[int, set[Handle]] = {}  # id(session) -> handles queued or running on it
        self._count = 0
        self._timed_out: set[int] = set()  # ids of handles cancelled for running past the timeout
        self._lock = threading.Lock()
        # request preparation (encoding, grammar compilation) runs off the event loop on these few threads
        self.prepare_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="onnxgen-prepare")
        self.metrics.gauge(
            "onnxgen_queue_depth",
            "Requests in flight (running or waiting for the engine).",
            lambda: self.depth,
        )
        self.metrics.gauge(
            "onnxgen_sessions", "Open sessions (including per-key default sessions).", lambda: len(self.store)
        )
        kv = model.kv_stats
        self.metrics.gauge(
            "onnxgen_retained_kv_bytes",
            "Bytes of KV retained by sessions.",
            lambda: kv()["retained_kv_bytes"],
        )
        self.metrics.gauge(
            "onnxgen_requests_running", "Requests the engine is running now.", lambda: kv()["running"]
        )
        self.metrics.gauge(
            "onnxgen_requests_waiting",
            "Requests waiting for the engine (in a session's queue or the engine's).",
            lambda: max(self.depth - kv()["running"], 0),
        )
        self.metrics.gauge(
            "onnxgen_preemptions",
            "Running requests preempted (KV dropped, recomputed) since start.",
            lambda: kv()["preemptions"],
        )
        if model.paged:
            self.metrics.gauge("onnxgen_kv_pages_used", "KV pool pages in use.", lambda: kv()["pages_used"])
            self.metrics.gauge("onnxgen_kv_pages_free", "KV pool pages free.", lambda: kv()["pages_free"])
            self.metrics.gauge(
                "onnxgen_kv_pages_shared",
                "KV pool pages held by more than one request or session.",
                lambda: kv()["pages_shared"],
            )
            self.metrics.gauge(
                "onnxgen_prefix_hit_rate",
                "Prompt tokens found in the prefix cache / prompt tokens looked up, since start.",
                lambda: _hit_rate(kv()),
            )

    @property
    def depth(self) -> int:
        """Requests in flight: submitted and not yet finished."""
        return self._count

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
        raise APIError(
            401, "missing or invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
        )

    def resolve_session(self, request: Any, owner: str) -> Session | None:
        """The session a request runs on: the one named by `X-Session-Id` (scoped to the key), else the
        key's default session. Without API keys nobody is known, so a request that names no session is its
        own context: None (it runs with `reuse=False` on a throwaway session and shares no KV)."""
        sid = request.headers.get(SESSION_HEADER)
        if sid is None:
            return self.store.default(owner) if self.keys else None
        session = self.store.get(owner, sid.strip())
        if session is None:
            raise APIError(
                404,
                f"unknown session {sid!r}: create one with POST /v1/sessions",
                param=SESSION_HEADER,
                code="session_not_found",
            )
        return session

    def submit(self, session: Session | None, call: Call, on_token: Any = None) -> Handle:
        """Queue a prepared request on `session` (call from the event loop). Raises APIError 429 when
        `capacity` requests are in flight, 404 when the session was deleted. While in flight it is registered
        under its session (so `DELETE /v1/sessions/{id}` can cancel it); past `request_timeout_s` it is
        cancelled (`timed_out`, answered 504)."""
        prepared = call.prepared
        if session is None:  # keyless and unnamed: its own context, nothing retained
            session = self.model.session(name="anonymous")
            prepared = dataclasses.replace(prepared, reuse=False)
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
            handle = session.submit(prepared, on_token=on_token)
        except BaseException:
            with self._lock:
                self._count -= 1
            raise
        key = id(session)
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

    def outcome(self, handle: Handle, exc: BaseException) -> BaseException:
        """What a failed request answers: a timeout's 504 for a request this server cancelled for running too
        long, else `exc` as it is."""
        with self._lock:
            timed_out = id(handle) in self._timed_out
            self._timed_out.discard(id(handle))
        if isinstance(exc, Cancelled) and timed_out:
            timeout = self.config.request_timeout_s
            return APIError(
                504,
                f"the request ran longer than this server's limit of {timeout:g} s and was cancelled; ask for "
                "fewer tokens",
                code="timeout",
            )
        return exc

    def cancel_running(self, session: Session) -> bool:
        """Cancel the requests queued or running on `session` (they stop at their next step); True if any."""
        with self._lock:
            handles = list(self._inflight.get(id(session), ()))
        for h in handles:
            h.cancel()
        return bool(handles)

    def record(self, result: Result) -> None:
        """Count a finished generation in the metrics."""
        s = result.stats
        self.metrics.generation(s.prompt_tokens, s.generated_tokens, s.reused_tokens, s.ttft_s)

    async def run_off_loop(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` on the preparation threads (work that would block the event loop)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.prepare_pool, lambda: fn(*args, **kwargs))

    def close(self) -> None:
        """Stop the preparation threads (requests end with the model's loop)."""
        self.prepare_pool.shutdown(wait=False, cancel_futures=True)
