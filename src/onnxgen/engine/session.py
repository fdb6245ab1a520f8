"""Sessions: one conversation's retained context, kept alive across requests.

    Session.generate(request)
      1. take      state = session.retained; session.retained = None        (docs/reuse.md, invariant 2)
      2. request   tokens + identity digest; the engine schedules it         (engine/engine.py)
      3. reuse     decoders: plan/apply Reset | Keep | Rewind on the taken decoder (engine/slots.py);
                   paged KV: the longest indexed prefix under the identity    (engine/paged.py)
      4. steps     chunked prefill of the suffix, decode, batched with others (engine/scheduler.py)
      5. commit    on success only: the new state (invariant 3)

The state is ONE value, opaque here: a decoder with exactly what its cache holds (`slots.Retained`), or
a pin on the index path of the last context (`paged.Pinned`); no path updates its KV without its
description. Any exception (including cancellation) between 1 and 5 drops the taken state: the failure
direction is "lose the speedup", never "corrupt the context".

A session also remembers the ids of its last context (its history: ints, not KV). A chat prompt is
encoded against them (`Engine.encode_prompt(held=...)`) whether or not the KV survived eviction, so the
ids a request runs on, and so its output, never depend on memory pressure; only the reuse does.

`SessionRegistry` bounds retained KV (LRU by count and bytes). A Session reaches its engine only
through `Runner`: this module does not import the engine.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from onnxgen.engine.result import Result


class Runner(Protocol):
    """What a Session needs from the engine that made it (`Engine` satisfies it)."""

    registry: SessionRegistry  # touch() a session after it commits; forget() it when closed

    def run_request(
        self, prompt: Any, *, owner: Any, held: Any, salt: str | None, **kwargs: Any
    ) -> tuple[Result, Any]:
        """Run one request whose context `owner` keeps; `held` is the owner's retained state, taken for
        the request (the engine disposes of it on every path); `history=` the ids of the owner's last
        context, which a chat prompt keeps where it spells them (`Engine.encode_prompt`) even when `held`
        was evicted. Returns the result and the new state to keep (None: nothing)."""
        ...

    def drop_state(self, state: Any) -> None:
        """Let go of a retained state (its KV is freed or becomes evictable)."""
        ...

    def state_bytes(self, state: Any) -> int:
        """Device bytes a retained state holds."""
        ...


class Session:
    """One conversation's retained context. Thread-safe: one request at a time (others wait).

    Use `Engine.session()` (or `Model.session()`) to make one. `closed` is True after `close()`.
    """

    _ids = itertools.count(1)

    def __init__(self, engine: Runner, name: str | None = None, *, salt: str | None = None) -> None:
        self.engine = engine
        self.name = name or f"session-{next(self._ids)}"
        self.salt = salt
        self._request_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._retained: Any = None  # the engine's state: a retained decoder, or a pin on the paged index
        self._history: tuple[int, ...] = ()  # the ids of the last context, kept when its KV is evicted
        self.last_used = time.monotonic()
        self.closed = False

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

    def evict(self) -> int:
        """Drop the retained KV (the session stays usable and simply reuses nothing it does not find in
        the cache next time). Returns the bytes the session held. Safe to call from another thread; a
        running request is untouched."""
        state = self._take()
        if state is None:
            return 0
        freed = self.engine.state_bytes(state)
        self.engine.drop_state(state)
        return freed

    @property
    def retained_tokens(self) -> int:
        """How many tokens the retained context covers (0 when nothing is retained)."""
        state = self._retained
        return len(state.identity.tokens) if state is not None else 0

    def kv_bytes(self) -> int:
        state = self._retained
        return self.engine.state_bytes(state) if state is not None else 0

    def clear(self) -> None:
        """Forget the retained context and its ids (e.g. the REPL's /reset); waits for a running request."""
        with self._request_lock:
            self.evict()
            self._history = ()

    def close(self) -> None:
        self.clear()
        self.closed = True
        self.engine.registry.forget(self)

    # --- requests ------------------------------------------------------------------------

    def generate(self, prompt: Any, **kwargs: Any) -> Result:
        """Generate with reuse of this session's retained context. Same arguments and result as
        `Model.generate` (see `Engine.run_request`). `reuse=False` computes from scratch and neither
        reads nor changes the retained state."""
        if self.closed:
            from onnxgen.errors import InvalidRequest

            raise InvalidRequest(f"{self.name} is closed", field="session")
        with self._request_lock:
            if not kwargs.get("reuse", True):
                result, _ = self.engine.run_request(prompt, owner=None, held=None, salt=self.salt, **kwargs)
                return result
            state = self._take()  # NOTE: from here on the session holds nothing (invariant 2)
            result, kept = self.engine.run_request(
                prompt, owner=self, held=state, history=self._history, salt=self.salt, **kwargs
            )
            if kept is not None:
                self._history = tuple(kept.identity.tokens)
                self._commit(kept)
                self.engine.registry.touch(self)
            return result


class SessionRegistry:
    """LRU bound on retained KV across an engine's sessions: at most `max_sessions` sessions hold
    a cache, and their caches total at most `max_kv_bytes` (None: unbounded). Eviction frees the
    least recently used session's KV; the session object stays valid."""

    def __init__(self, max_sessions: int = 8, max_kv_bytes: int | None = None) -> None:
        self.max_sessions = max_sessions
        self.max_kv_bytes = max_kv_bytes
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
            s.evict()
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
