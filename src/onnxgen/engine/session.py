"""Sessions: a decoder and the description of what its cache holds, kept alive across requests.

    Session.generate(request)
      1. take      state = session.retained; session.retained = None      (REUSE.md 2)
      2. identity  tokens + digest of every non-token input                (engine/identity.py)
      3. reuse     plan/apply on the taken decoder: Reset | Keep | Rewind  (engine/reuse.py)
      4. loop      chunked prefill of the suffix, decode                   (engine/loop.py)
      5. commit    on success only: Retained(decoder, prompt + generated[:-1], digest)  (REUSE.md 3)

The retained decoder and its identity are ONE value (`Retained`); no path updates one without the
other. Any exception (including cancellation) between 1 and 5 drops the taken state: the failure
direction is "lose the speedup", never "corrupt the context".

Decoders share their model's weights; a `DecoderPool` hands out empty ones and takes back the
caches of dropped or evicted states. `SessionRegistry` bounds retained KV (LRU by count and bytes).
A Session reaches its engine only through `Runner` (pool, registry, `run_request`): this module does
not import the engine.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from onnxgen.backends.base import Decoder
from onnxgen.engine import reuse
from onnxgen.engine.identity import Identity

if TYPE_CHECKING:
    from onnxgen.engine.result import Result


@dataclass(frozen=True)
class Retained:
    """A live decoder plus exactly what its cache holds. Immutable; replaced, never edited."""

    decoder: Decoder
    identity: Identity

    def __post_init__(self) -> None:
        assert self.identity.digest is not None, "undigestable contexts are never retained"


class DecoderPool:
    """Makes decoders that share one loaded model, and recycles emptied ones.

    `factory()` builds a new empty decoder. `release(d)` empties `d` and keeps it, buffers allocated
    (`Decoder.reset`), for the next `acquire`; beyond `keep` idle decoders it closes `d` (frees its
    memory). `close()` frees every idle decoder's memory.
    """

    def __init__(self, factory: Callable[[], Decoder], keep: int = 2) -> None:
        self._factory = factory
        self._free: list[Decoder] = []
        self._keep = keep
        self._lock = threading.Lock()

    def acquire(self) -> Decoder:
        with self._lock:
            if self._free:
                return self._free.pop()
        return self._factory()

    def close(self) -> None:
        """Close every idle decoder (frees their caches); later `acquire` calls build new ones."""
        with self._lock:
            free, self._free = self._free, []
        for d in free:
            d.close()

    @property
    def idle(self) -> int:
        """How many emptied decoders wait for an `acquire`."""
        with self._lock:
            return len(self._free)

    def kv_bytes(self) -> int:
        """Device memory the idle decoders' (empty) caches keep allocated, in bytes."""
        with self._lock:
            return sum(d.kv_bytes() for d in self._free)

    def release(self, decoder: Decoder | None) -> None:
        """Empty `decoder`'s cache and keep the decoder (with its buffers) for later requests; a surplus
        or broken decoder is closed instead (its memory freed)."""
        if decoder is None:
            return
        try:
            reuse.clear(decoder)
        except Exception:  # a broken decoder is not worth keeping
            decoder.close()
            return
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(decoder)
                return
        decoder.close()


class Runner(Protocol):
    """What a Session needs from the engine that made it (`Engine` satisfies it)."""

    pool: DecoderPool  # acquire() an empty decoder; release() one whose context is dropped
    registry: SessionRegistry  # touch() a session after it commits; forget() it when closed

    def run_request(
        self, decoder: Decoder, held: Identity | None, prompt: Any, **kwargs: Any
    ) -> tuple[Result, Identity]:
        """Run one request on `decoder`, whose cache holds `held` (None: nothing known); return the result
        and the identity of what the cache holds afterwards (see `Engine.run_request`)."""
        ...


class Session:
    """One conversation's retained context. Thread-safe: one request at a time (others wait).

    Use `Engine.session()` (or `Model.session()`) to make one.
    """

    _ids = itertools.count(1)

    def __init__(self, engine: Runner, name: str | None = None) -> None:
        self.engine = engine
        self.name = name or f"session-{next(self._ids)}"
        self._request_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._retained: Retained | None = None
        self.last_used = time.monotonic()
        self.closed = False

    # --- retained state: take / commit / evict (all under _state_lock) ---------------------

    def _take(self) -> Retained | None:
        with self._state_lock:
            state, self._retained = self._retained, None
        return state

    def _commit(self, state: Retained) -> None:
        with self._state_lock:
            assert self._retained is None, "a request's state is committed into an occupied session"
            self._retained = state
            self.last_used = time.monotonic()

    def evict(self) -> int:
        """Drop the retained KV (the session stays usable and simply reuses nothing next time): its
        decoder goes back to the engine's pool. Returns the bytes the session held. Safe to call from
        another thread; a running request is untouched."""
        state = self._take()
        if state is None:
            return 0
        freed = state.decoder.kv_bytes()
        self.engine.pool.release(state.decoder)
        return freed

    @property
    def retained_tokens(self) -> int:
        """How many tokens the retained cache covers (0 when nothing is retained)."""
        state = self._retained
        return len(state.identity.tokens) if state is not None else 0

    def kv_bytes(self) -> int:
        state = self._retained
        return state.decoder.kv_bytes() if state is not None else 0

    def clear(self) -> None:
        """Forget the retained context (e.g. the REPL's /reset); waits for a running request."""
        with self._request_lock:
            self.evict()

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
                decoder = self.engine.pool.acquire()
                try:
                    result, _ = self.engine.run_request(decoder, None, prompt, **kwargs)
                finally:
                    self.engine.pool.release(decoder)
                return result
            state = self._take()  # NOTE: from here on the session holds nothing (invariant 2)
            decoder = state.decoder if state is not None else self.engine.pool.acquire()
            held = state.identity if state is not None else None
            try:
                result, identity = self.engine.run_request(decoder, held, prompt, **kwargs)
            except BaseException:
                self.engine.pool.release(decoder)
                raise
            if identity.retainable:
                self._commit(Retained(decoder, identity))
                self.engine.registry.touch(self)
            else:
                self.engine.pool.release(decoder)
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
