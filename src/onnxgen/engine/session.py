"""Sessions: one conversation's retained context, kept alive across requests.

    Session.submit(request)
      1. take      state = session.retained; session.retained = None        (docs/reuse.md, invariant 2)
      2. request   tokens + identity digest; the engine schedules it         (engine/engine.py)
      3. reuse     decoders: plan/apply Reset | Keep | Rewind on the taken decoder (engine/slots.py);
                   paged KV: the longest indexed prefix under the identity    (engine/paged.py)
      4. steps     chunked prefill of the suffix, decode, batched with others (engine/scheduler.py)
      5. commit    on success only: the new state (invariant 3), by the request's `on_done`

The state is ONE value, opaque here: a decoder with exactly what its cache holds (`slots.Retained`), or a pin
on the index path of the last context (`paged.Pinned`); no path updates its KV without its description. Any
failure (including cancellation) between 1 and 5 drops the taken state: the failure direction is "lose the
speedup", never "corrupt the context".

A session runs one request at a time: a request submitted while another runs waits in the session's queue
and starts when it is done (started by the previous one's `on_done`, so no thread waits for it). A session
also remembers the ids of its last context (its history: ints, not KV). A chat prompt is encoded against
them (`InputProcessor.rebase`) whether or not the KV survived eviction, so the ids a request runs on, and so
its output, never depend on memory pressure; only the reuse does.

`SessionRegistry` bounds retained KV (LRU by count and bytes); a session it pushes out drops its KV, or with
tiers spills it to host memory or a file it resumes from (`engine/spill.py`). A Session reaches its engine only through
`Runner`: this module does not import the engine.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any, Protocol

from onnxgen.engine.output import Handle

if TYPE_CHECKING:
    from onnxgen.engine.input import Prepared
    from onnxgen.engine.output import Result
    from onnxgen.engine.request import Request


class Runner(Protocol):
    """What a Session needs from the engine that made it (`Engine` satisfies it)."""

    registry: SessionRegistry  # touch() a session after it commits; forget() it when closed

    def prepare(self, prompt: Any, **options: Any) -> Prepared:
        """Check and encode a request (`InputProcessor.prepare`)."""
        ...

    def submit(self, prepared: Prepared, *, owner: Any, held: Any, history: Any, salt: str | None,
               on_token: Any, cancel: Any, on_done: Any) -> Request:  # fmt: skip
        """Queue `prepared` for `owner`, holding `held` (the engine disposes of it on every path); `on_done(req)`
        is called once it is over, on the engine's thread."""
        ...

    def result_of(self, req: Request) -> Result: ...

    def drop_state(self, state: Any) -> None:
        """Let go of a retained state (its KV is freed or becomes evictable)."""
        ...

    def state_bytes(self, state: Any) -> int:
        """Device bytes a retained state holds."""
        ...

    def save_state(self, state: Any, path: Any, salt: str | None, name: str = "", note: str = "") -> int:
        """Write a retained state to a session file; returns its size."""
        ...

    def load_state(self, path: Any, salt: str | None) -> tuple[Any, Any]:
        """A session file's header and the retained state made from it (raises `SessionFileError`)."""
        ...


class Session:
    """One conversation's retained context. Thread-safe: its requests run one at a time, in submission order.

    Use `Model.session()` to make one. `closed` is True after `close()`.
    """

    _ids = itertools.count(1)

    def __init__(
        self, engine: Runner, name: str | None = None, *, salt: str | None = None, history: Any = ()
    ) -> None:
        self.engine = engine
        self.name = name or f"session-{next(self._ids)}"
        self.salt = salt
        self._state_lock = threading.Lock()
        self._retained: Any = None  # the engine's state: a retained decoder, or a pin on the paged index
        # the ids of the last context (kept when its KV is evicted); at first, those of a context it continues
        self._history: tuple[int, ...] = tuple(history)
        self._queue: deque[tuple[Prepared, Handle, Any]] = deque()
        self._busy = False  # a request of this session is in the engine
        self._idle = threading.Condition()
        self.last_used = time.monotonic()
        self.closed = False
        self.note = ""  # a restored session's file's note (`save`)
        self._spilled: Any = None  # its context out of the device (`engine/spill.Spilled`), until it resumes

    # --- retained state: take / commit / evict (all under _state_lock) ---------------------

    def _take(self) -> Any:
        with self._state_lock:
            state, self._retained = self._retained, None
        return state

    def _commit(self, state: Any) -> None:
        with self._state_lock:
            assert self._retained is None, "a request's state is committed into an occupied session"
            self._retained = state
            self.last_used = time.monotonic()

    def spill(self, spill: Any, now: bool = False) -> int:
        """Hand the retained KV to the host and disk tiers (`Spill.put`: moved and freed off this thread); the
        next request resumes from there. Returns the bytes the session held (0: it held nothing)."""
        state = self._take()
        if state is None:
            return 0
        freed = self.engine.state_bytes(state)
        self._spilled = spill.put(state, self.salt, self.name, now)
        return freed

    def offload(self) -> int:
        """Move the retained context out of device memory now, into the tiers the model was loaded with
        (`host_kv_bytes`: host memory; `kv_dir`: a session file); the next request restores it from there
        instead of recomputing it. Returns the bytes the session held on the device (0: nothing retained, or
        no tier). Waits for the session's running requests."""
        spill = self.engine.registry.spill
        if spill is None:
            return 0
        self.wait_idle()
        return self.spill(spill, now=True)

    def _unspill(self) -> None:
        """Before a request, on its caller's thread, with the session busy: the spilled context back from the
        host or disk tier (one that was dropped, or cannot be restored, is recomputed by the request)."""
        import logging

        from onnxgen.errors import OnnxgenError

        item, self._spilled = self._spilled, None
        tiers = self.engine.registry.spill
        if item is None or tiers is None:
            return
        try:
            state = tiers.take(item) if self._retained is None else tiers.discard(item)
        except OnnxgenError as exc:
            logging.getLogger(__name__).warning("%s recomputes its context: %s", self.name, exc)
            return
        if state is not None:
            self._history = item.tokens
            self._commit(state)
            self.engine.registry.touch(self)

    def evict(self) -> int:
        """Drop the retained KV (the session stays usable and simply reuses nothing it does not find in the
        cache next time). Returns the bytes the session held. Safe to call from any thread; a running request
        is untouched."""
        state = self._take()
        if state is None:
            return 0
        freed = self.engine.state_bytes(state)
        self.engine.drop_state(state)
        return freed

    @property
    def history(self) -> tuple[int, ...]:
        """The token ids of the session's last context (kept when its KV is evicted)."""
        return self._history

    @property
    def retained_tokens(self) -> int:
        """How many tokens the retained context covers (0 when nothing is retained)."""
        state = self._retained
        return len(state.identity.tokens) if state is not None else 0

    def kv_bytes(self) -> int:
        state = self._retained
        return self.engine.state_bytes(state) if state is not None else 0

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request of this session is queued or running; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._busy, timeout)

    def clear(self) -> None:
        """Forget the retained context and its ids (e.g. the REPL's /reset); waits for running requests."""
        self.wait_idle()
        self.evict()
        item, self._spilled = self._spilled, None
        if item is not None and self.engine.registry.spill is not None:
            self.engine.registry.spill.discard(item)
        self._history = ()

    def close(self) -> None:
        """Clear and close: requests submitted later raise `InvalidRequest`; queued ones are cancelled."""
        self.closed = True
        with self._idle:
            for _, handle, _ in self._queue:
                handle.cancel()
        self.clear()
        self.engine.registry.forget(self)

    # --- session files -------------------------------------------------------------------

    def save(self, path: Any, note: str = "") -> int:
        """Write the retained context to `path` as a session file (`kv/files.py`: its KV and token ids, bound
        to the package, the backend and this session's salt; `note`: the application's own text, given back
        as the restored session's `note`), atomically; returns its size in bytes. Waits
        for the session's running requests (requests submitted meanwhile wait for the save). Raises
        `InvalidRequest` when nothing is retained (no turn yet, evicted, or closed). The session goes on."""
        from onnxgen.errors import InvalidRequest

        with self._idle:
            self._idle.wait_for(lambda: not self._busy)
            self._busy = True  # NOTE: requests queue behind the save (`_next` starts them)
        try:
            state = self._take()
            if state is None:
                raise InvalidRequest(
                    f"{self.name} retains no context to save (no turn yet, or evicted)", field="path"
                )
            try:
                return self.engine.save_state(state, path, self.salt, self.name, note=note)
            finally:
                self._commit(state)
        finally:
            self._next()

    def adopt(self, state: Any) -> None:
        """Attach a retained state made for this session (a restored session file) before its first request:
        its history becomes the state's tokens."""
        assert not self._busy and self._retained is None, "adopt is for a new session"
        self._history = tuple(state.identity.tokens)
        self._commit(state)
        self.engine.registry.touch(self)

    # --- requests ------------------------------------------------------------------------

    def generate(self, prompt: Any, **options: Any) -> Result:
        """Generate with reuse of this session's retained context and wait for the result. Same arguments and
        result as `Model.generate`. `reuse=False` computes from scratch and neither reads nor changes the
        retained state."""
        return self.submit(prompt, **options).result()

    def submit(self, prompt: Any, *, on_token: Any = None, cancel: threading.Event | None = None,
               **options: Any) -> Handle:  # fmt: skip
        """Queue a request on this session and return its `Handle` at once. `prompt`: what `Model.generate`
        takes, or a `Prepared` request (then no other options). Raises `InvalidRequest` (bad options, or the
        session is closed) before anything is queued."""
        from onnxgen.engine.input import Prepared
        from onnxgen.errors import InvalidRequest

        if self.closed:
            raise InvalidRequest(f"{self.name} is closed", field="session")
        if isinstance(prompt, Prepared):
            if options:
                raise InvalidRequest("a prepared request takes no options", field=next(iter(options)))
            prepared = prompt
        else:
            prepared = self.engine.prepare(prompt, **options)
        handle = Handle(cancel)
        with self._idle:
            self._queue.append((prepared, handle, on_token))
            if self._busy:
                return handle
            self._busy = True
        if self._spilled is not None and prepared.reuse:
            self._unspill()
        self._next()
        return handle

    def _next(self) -> None:
        """Start the first queued request (the session is busy; it goes idle when nothing is queued)."""
        from onnxgen.errors import InvalidRequest

        while True:
            with self._idle:
                if not self._queue:
                    self._busy = False
                    self._idle.notify_all()
                    return
                prepared, handle, on_token = self._queue.popleft()
            if self.closed:
                handle.set_error(InvalidRequest(f"{self.name} is closed", field="session"))
                continue
            reuse = prepared.reuse
            state = (
                self._take() if reuse else None
            )  # NOTE: from here on the session holds nothing (invariant 2)
            try:
                self.engine.submit(
                    prepared,
                    owner=self if reuse else None,
                    held=state,
                    history=self._history if reuse else (),
                    salt=self.salt,
                    on_token=on_token,
                    cancel=handle.cancel_event,
                    on_done=lambda req, h=handle: self._done(req, h),
                )
            except BaseException as exc:  # the engine dropped the taken state
                handle.set_error(exc)
                continue
            return

    def _done(self, req: Request, handle: Handle) -> None:
        """The engine's `on_done`: commit what the request keeps (on success only), answer its handle, start the
        next queued request."""
        try:
            if req.error is not None:
                handle.set_error(req.error)
                return
            kept, req.kept = req.kept, None
            if kept is not None:
                if self.closed:
                    self.engine.drop_state(kept)
                else:
                    self._history = tuple(kept.identity.tokens)
                    self._commit(kept)
                    self.engine.registry.touch(self)
            handle.set_result(self.engine.result_of(req))
        finally:
            self._next()


class SessionRegistry:
    """LRU bound on retained KV across an engine's sessions: at most `max_sessions` sessions hold a cache, and
    their caches total at most `max_kv_bytes` (None: unbounded). Eviction frees the least recently used
    session's KV; the session object stays valid."""

    def __init__(self, max_sessions: int = 8, max_kv_bytes: int | None = None, spill: Any = None) -> None:
        self.max_sessions = max_sessions
        self.max_kv_bytes = max_kv_bytes
        self.spill = (
            spill  # the host / disk tiers (`engine/spill.Spill`) or None: sessions pushed out recompute
        )
        self._lru: OrderedDict[int, Session] = OrderedDict()
        self._lock = threading.Lock()
        self.evictions = 0

    def touch(self, session: Session) -> None:
        """Mark `session` most recently used, then evict others until within bounds."""
        with self._lock:
            self._lru[id(session)] = session
            self._lru.move_to_end(id(session))
            victims: list[Session] = []
            holders = [s for s in self._lru.values() if s.retained_tokens > 0]
            total = sum(s.kv_bytes() for s in holders)
            for s in list(self._lru.values()):
                if s is session:
                    continue
                over_count = len(holders) > self.max_sessions
                over_bytes = self.max_kv_bytes is not None and total > self.max_kv_bytes
                if not (over_count or over_bytes):
                    break
                if s in holders:
                    holders.remove(s)
                    total -= s.kv_bytes()
                    victims.append(s)
                del self._lru[id(s)]
        for s in victims:
            s.spill(self.spill) if self.spill is not None else s.evict()
            self.evictions += 1
        if self.max_kv_bytes is not None and session.kv_bytes() > self.max_kv_bytes:
            session.evict()
            self.evictions += 1

    def evict_all(self) -> None:
        """Free every registered session's retained KV (the sessions stay usable)."""
        with self._lock:
            sessions = list(self._lru.values())
        for s in sessions:
            s.evict()

    def forget(self, session: Session) -> None:
        with self._lock:
            self._lru.pop(id(session), None)

    def total_kv_bytes(self) -> int:
        with self._lock:
            return sum(s.kv_bytes() for s in self._lru.values())

    def stats(self) -> dict[str, int]:
        """`retained_kv_bytes`, and with tiers their contents (`Spill.stats`)."""
        out = {"retained_kv_bytes": self.total_kv_bytes()}
        return out | self.spill.stats() if self.spill is not None else out

    def close(self) -> None:
        """Free every session's KV and the tiers' (their files deleted: the model closes)."""
        self.evict_all()
        if self.spill is not None:
            self.spill.close()
