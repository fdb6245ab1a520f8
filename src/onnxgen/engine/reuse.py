"""The one reuse policy, pure, and its application through the backend seam.

    plan(shared, current, can_rewind) -> Reset | Keep | Rewind(n)

`shared` is the longest common prefix of the retained and the new tokens (0 when identities differ),
already capped at `len(new) - 1` so at least one token is computed for logits; `current` is the
cache's `kv_len()`. This module is the only one that calls `kv_len`, `rewind_to` and `reset` on a
decoder (a test enforces it).

    retained:  t0 t1 t2 t3 t4 t5        (kv_len = 6)
    new:       t0 t1 t2 x3 x4           shared = 3 -> Rewind(3): keep t0..t2, prefill x3 x4
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from onnxgen.backends.base import Decoder
from onnxgen.engine.identity import Identity


@dataclass(frozen=True)
class Reset:
    """Empty the cache; prefill everything."""


@dataclass(frozen=True)
class Keep:
    """The cache holds exactly a prefix of the new prompt; prefill the rest."""


@dataclass(frozen=True)
class Rewind:
    """Truncate the cache to its first `n` positions, then prefill the rest."""

    n: int


Plan = Reset | Keep | Rewind


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def shared_prefix(retained: Identity | None, new: Identity) -> int:
    """Tokens of `new` whose KV the retained context can supply: LCP, 0 on identity mismatch,
    capped at len(new) - 1."""
    if retained is None or retained.digest is None or retained.digest != new.digest:
        return 0
    return min(common_prefix(retained.tokens, new.tokens), max(len(new.tokens) - 1, 0))


def plan(shared: int, current: int, can_rewind: bool) -> Plan:
    """Decide how to reuse the cache. Pure."""
    assert shared >= 0 and current >= 0
    reusable = min(shared, current)
    if reusable == 0:
        return Reset()
    if reusable == current:
        return Keep()
    return Rewind(reusable) if can_rewind else Reset()


def apply(p: Plan, decoder: Decoder) -> int:
    """Carry out `p` on `decoder`; return the number of cached positions kept (the reused tokens).

    A declined rewind resets. Afterwards `decoder.kv_len()` equals the returned count (asserted).
    """
    if isinstance(p, Keep):
        kept = decoder.kv_len()
    elif isinstance(p, Rewind):
        kept = p.n
        if not decoder.rewind_to(p.n):
            decoder.reset()
            kept = 0
    else:
        decoder.reset()
        kept = 0
    assert decoder.kv_len() == kept, f"cache holds {decoder.kv_len()} positions, expected {kept}"
    return kept


def prepare(decoder: Decoder, retained: Identity | None, new: Identity) -> int:
    """Plan and apply reuse of `decoder` (holding `retained`) for `new`; return the reused count."""
    shared = shared_prefix(retained, new)
    return apply(plan(shared, decoder.kv_len(), decoder.can_rewind), decoder)


def clear(decoder: Decoder) -> None:
    """Empty a decoder's cache (eviction, failure, or a fresh `reuse=False` run)."""
    decoder.reset()
    assert decoder.kv_len() == 0


def discard(decoder: Decoder, keep: int) -> None:
    """Drop the positions past `keep` that a verification forward fed (rejected draft tokens): the cache
    then holds exactly the accepted context. Only called on decoders that can rewind."""
    assert decoder.can_rewind and keep <= decoder.kv_len()
    ok = decoder.rewind_to(keep)
    assert ok and decoder.kv_len() == keep
