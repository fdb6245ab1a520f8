"""The state behind one server app: its configuration (`ServerConfig`) and `Server` (the model, the engine
workers, the session store, metrics, authentication, and the requests running now, so they can be
cancelled). Routes and streaming read it; `app.py` builds it."""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from onnxgen.errors import APIError, Cancelled, QueueFull
from onnxgen.serve.metrics import Metrics
from onnxgen.serve.openai import Logprobs, Prepared
from onnxgen.serve.sessions import SESSION_HEADER, SessionStore
from onnxgen.serve.worker import EngineWorker, Job


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


def _hit_rate(stats: dict[str, Any]) -> float:
    looked = stats.get("prefix_lookup_tokens", 0)
    return stats.get("prefix_hit_tokens", 0) / looked if looked else 0.0


def _key_id(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class Server:
    """The state behind one app (`app.state.server`): model, worker, sessions, metrics; who is calling,
    which session a request runs on, and the requests running now (so they can be cancelled)."""

    def __init__(self, model: Any, config: ServerConfig) -> None:
        self.model = model
        self.config = config
        self.model_id = config.model_id or model.spec.path.name
        self.model_names = {self.model_id, *config.aliases}
        self.keys = {_key_id(k): k for k in config.api_keys}
        self.worker = EngineWorker(config.max_queue, threads=model.max_running)
        self.store = SessionStore(model, config.max_sessions_per_key, keyed=bool(config.api_keys))
        self.logprobs = Logprobs(model)
        self.metrics = Metrics()
        self.metrics.gauge(
            "onnxgen_queue_depth",
            "Requests waiting for or running on the engine worker.",
            lambda: self.worker.depth,
        )
        self.metrics.gauge(
            "onnxgen_sessions", "Open sessions (including per-key default sessions).", lambda: len(self.store)
        )
        self.metrics.gauge(
            "onnxgen_retained_kv_bytes", "Bytes of KV retained by sessions.", model.retained_kv_bytes
        )
        kv = model.kv_stats
        self.metrics.gauge(
            "onnxgen_requests_running", "Requests the engine is running now.", lambda: kv()["running"]
        )
        self.metrics.gauge(
            "onnxgen_requests_waiting",
            "Requests waiting for the engine (in its queue or for a worker thread).",
            lambda: kv()["waiting"] + self.worker.waiting,
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
        self.created = int(time.time())
        self._running: dict[int, threading.Event] = {}  # id(session) -> cancel event of its running request
        self._running_lock = threading.Lock()

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

    def resolve_session(self, request: Any, owner: str) -> Any:
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

    def submit(self, session: Any, prep: Prepared, on_token: Any = None) -> Job:
        """Queue a prepared request on the engine worker (APIError 429 when the queue is full). While it runs
        it is registered under its session (so `DELETE /v1/sessions/{id}` can cancel it) and a timer cancels
        it after `request_timeout_s` (answered 504)."""
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
                    raise APIError(
                        504,
                        f"the request ran longer than this server's limit of {timeout:g} s and was "
                        "cancelled; ask for fewer tokens",
                        code="timeout",
                    ) from None
                raise
            finally:
                timer.cancel()
                with self._running_lock:
                    self._running.pop(id(target), None)

        try:
            return self.worker.submit(run)
        except QueueFull:
            raise APIError(
                429,
                f"the server is busy ({self.config.max_queue} requests waiting); retry later",
                code="queue_full",
                headers={"Retry-After": str(self.config.retry_after_s)},
            ) from None

    def cancel_running(self, session: Any) -> bool:
        """Cancel the request running on `session` (it stops at its next step); True if there was one."""
        with self._running_lock:
            cancel = self._running.get(id(session))
        if cancel is not None:
            cancel.set()
        return cancel is not None

    def record(self, result: Any) -> None:
        """Count a finished generation in the metrics."""
        s = result.stats
        self.metrics.generation(s.prompt_tokens, s.generated_tokens, s.reused_tokens, s.ttft_s)

    def close(self) -> None:
        self.worker.close(timeout=1.0)
