"""One decoder per request: the single-slot KV of backends that run batch 1 (ort; native packages that
cannot be batched).

Each running request owns a `Decoder` (its own contiguous KV). A session keeps its decoder between
requests as `Retained(decoder, identity)` — one value, so the KV and the description of what it holds
never diverge (docs/reuse.md, invariant 1). Admission takes the session's decoder (or an empty one from
the pool) and applies the one reuse policy (`engine/reuse.py`: Reset | Keep | Rewind) against what it
holds. A request that holds nothing (a stateless request, or a session's first turn) looks among the
`Stash`: the contexts of recent requests nobody keeps (a few decoders, matched by longest prefix under the
same identity digest, as llama.cpp's slots are), so stateless clients reuse a conversation's prefix too.
A step runs each scheduled chunk on its request's decoder, one after another.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
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


class Stash:
    """The retained contexts of finished requests that no session keeps (stateless requests), at most `keep`
    (least recently stored dropped first, their decoders back to the pool). `take(identity)` removes and
    returns the entry sharing the longest prefix with `identity` (same digest; at least one token), so an
    entry is only ever used by one request (docs/reuse.md, invariant 2). Thread-safe."""

    def __init__(self, pool: DecoderPool, keep: int) -> None:
        self.pool = pool
        self.keep = keep
        self._entries: OrderedDict[int, Retained] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, new: Identity) -> Retained | None:
        """The entry whose context shares the most tokens with `new` (None: none shares any), removed."""
        with self._lock:
            best, best_n = None, 0
            for key, entry in self._entries.items():
                n = reuse.shared_prefix(entry.identity, new)
                if n > best_n:
                    best, best_n = key, n
            return self._entries.pop(best) if best is not None else None

    def put(self, entry: Retained) -> None:
        """Keep `entry` (the most recent); beyond `keep` entries the oldest decoder goes back to the pool."""
        with self._lock:
            self._entries[id(entry)] = entry
            out = []
            while len(self._entries) > self.keep:
                out.append(self._entries.popitem(last=False)[1])
        for old in out:
            self.pool.release(old.decoder)

    def clear(self) -> None:
        """Drop every entry (decoders back to the pool)."""
        with self._lock:
            out, self._entries = list(self._entries.values()), OrderedDict()
        for old in out:
            self.pool.release(old.decoder)

    def __len__(self) -> int:
        return len(self._entries)

    def kv_bytes(self) -> int:
        with self._lock:
            return sum(e.decoder.kv_bytes() for e in self._entries.values())


class SlotKV:
    """The scheduler's KV adapter and the step's executor for per-request decoders. `stateless`: how many
    contexts of requests nobody keeps are retained for later requests to match (`Stash`; 0: none).
    `counters`: more numbers for `stats` (a vision package's `Parts.counters`)."""

    paged = False
    verify_sizes: tuple[int, ...] = ()  # a decoder's verify step costs what its positions do

    def __init__(
        self,
        pool: DecoderPool,
        stateless: int = 0,
        counters: Callable[[], dict[str, int]] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        """`on_close`: called last by `close` (a tensor-parallel group's workers stop there)."""
        self.pool = pool
        self.stash = Stash(pool, stateless)
        self._counters = counters
        self._on_close = on_close

    # --- the scheduler's calls ---------------------------------------------------------------------

    def admit(self, req: Request) -> bool:
        held: Retained | None = req.held
        req.held = None  # NOTE: the retained decoder now belongs to the request (invariant 2)
        new = Identity(tuple(req.tokens), req.digest)
        if held is None and req.reuse and req.digest is not None and self.stash.keep:
            held = self.stash.take(new)  # NOTE: taken out of the stash: this request's alone
        decoder = held.decoder if held is not None else self.pool.acquire()
        known = held.identity if held is not None and req.reuse else None
        req.kv = decoder
        req.computed = reuse.prepare(decoder, known, new)
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
        """After success: what the request's session keeps (its decoder and the fed tokens), or None: nobody
        keeps it, and its context goes to the stash (a request with `reuse`) or its decoder to the pool."""
        decoder, req.kv = req.kv, None
        if req.reuse and req.digest is not None:
            kept = Retained(decoder, Identity(tuple(req.fed), req.digest))
            if req.owner is not None:
                return kept
            if self.stash.keep:
                self.stash.put(kept)
                return None
        self.pool.release(decoder)
        return None

    def drop(self, state: Retained | None) -> None:
        """A session's retained state is no longer wanted: its decoder goes back to the pool."""
        if state is not None:
            self.pool.release(state.decoder)

    def state_bytes(self, state: Retained | None) -> int:
        return state.decoder.kv_bytes() if state is not None else 0

    def export(self, state: Retained) -> list[tuple[Any, Any]]:
        """Host copies of a retained context's KV (`Decoder.export_kv`), for a session file."""
        layers = state.decoder.export_kv()
        assert not layers or layers[0][0].shape[1] == len(state.identity.tokens), (
            "a retained decoder holds its context"
        )
        return layers

    def restore(self, identity: Identity, layers: Sequence[tuple[Any, Any]]) -> Retained:
        """A retained context holding `layers`, the KV of `identity.tokens`, on a decoder from the pool."""
        decoder = self.pool.acquire()
        try:
            decoder.import_kv(identity.tokens, layers)
        except BaseException:
            self.pool.release(decoder)
            raise
        return Retained(decoder, identity)

    def stats(self) -> dict[str, int]:
        return {
            "idle_decoders": self.pool.idle,
            "idle_kv_bytes": self.pool.kv_bytes(),
            "stateless_contexts": len(self.stash),
            "stateless_kv_bytes": self.stash.kv_bytes(),
            **(self._counters() if self._counters is not None else {}),
        }

    def close(self) -> None:
        self.stash.clear()
        self.pool.close()
        if self._on_close is not None:
            self._on_close()
