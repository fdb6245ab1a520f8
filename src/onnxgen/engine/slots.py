"""One decoder per request: the single-slot KV of backends that run batch 1 (ort; native packages that
cannot be batched).

Each running request owns a `Decoder` (its own contiguous KV). A session keeps its decoder between
requests as `Retained(decoder, identity)` — one value, so the KV and the description of what it holds
never diverge (docs/reuse.md, invariant 1). Admission takes the session's decoder (or an empty one from
the pool) and applies the one reuse policy (`engine/reuse.py`: Reset | Keep | Rewind) against what it
holds; this is the prefix index of a single slot: the only context a request can match is its own
session's. A step runs each scheduled chunk on its request's decoder, one after another.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from onnxgen.backends.base import Decoder
from onnxgen.engine import reuse
from onnxgen.engine.identity import Identity
from onnxgen.engine.request import Request
from onnxgen.engine.scheduler import Chunk


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


class SlotKV:
    """The scheduler's KV adapter and the step's executor for per-request decoders."""

    paged = False
    verify_sizes: tuple[int, ...] = ()  # a decoder's verify step costs what its positions do

    def __init__(self, pool: DecoderPool) -> None:
        self.pool = pool

    # --- the scheduler's calls ---------------------------------------------------------------------

    def admit(self, req: Request) -> bool:
        held: Retained | None = req.held
        req.held = None  # NOTE: the retained decoder now belongs to the request (invariant 2)
        decoder = held.decoder if held is not None else self.pool.acquire()
        known = held.identity if held is not None and req.reuse else None
        req.kv = decoder
        req.computed = reuse.prepare(decoder, known, Identity(tuple(req.tokens), req.digest))
        if not decoder.can_rewind:
            req.drafts = None  # rejected drafts could not be taken back out of the cache
        return True

    def defer(self, req: Request) -> bool:
        """Never: a decoder per request shares nothing with running requests."""
        return False

    def reserve(self, req: Request, total: int) -> bool:
        return True  # a decoder grows its own cache

    def release(self, req: Request) -> None:
        self.pool.release(req.kv)
        req.kv = None

    # --- the engine's calls ------------------------------------------------------------------------

    def run(self, chunks: Sequence[Chunk]) -> list[Any]:
        """Each chunk on its request's decoder, in order. Per chunk: the last position's logits when it
        samples (with drafts: `[1 + drafts, vocab]`, every fed position's), else None; an exception in
        place of either when that request's forward failed."""
        out: list[Any] = []
        for c in chunks:
            req = c.req
            try:
                if c.draft:  # the last sampled token and the drafts: every position's logits, to verify
                    tokens = [*req.token_slice(c.start, c.n), *c.draft]
                    logits = req.kv.forward(tokens, c.start, req.inputs, rows=len(tokens))
                else:
                    logits = req.kv.forward(req.token_slice(c.start, c.n), c.start, req.inputs)
            except Exception as exc:
                out.append(exc)
                continue
            out.append(logits if c.sample else None)
        return out

    def discard(self, req: Request, keep: int) -> None:
        """Rejected drafts: the request's cache keeps its first `keep` positions."""
        reuse.discard(req.kv, keep)

    def finish(self, req: Request) -> Retained | None:
        """After success: what the request's session keeps (its decoder and the fed tokens), or None
        (nobody keeps it: the decoder goes back to the pool)."""
        decoder, req.kv = req.kv, None
        if req.owner is not None and req.reuse and req.digest is not None:
            return Retained(decoder, Identity(tuple(req.fed), req.digest))
        self.pool.release(decoder)
        return None

    def drop(self, state: Retained | None) -> None:
        """A session's retained state is no longer wanted: its decoder goes back to the pool."""
        if state is not None:
            self.pool.release(state.decoder)

    def state_bytes(self, state: Retained | None) -> int:
        return state.decoder.kv_bytes() if state is not None else 0

    def stats(self) -> dict[str, int]:
        return {"idle_decoders": self.pool.idle, "idle_kv_bytes": self.pool.kv_bytes()}

    def close(self) -> None:
        self.pool.close()
