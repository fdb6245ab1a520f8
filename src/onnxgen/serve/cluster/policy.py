"""Which replica serves a request: the routing policy as plain Python (no Ray), so it is tested on its own.

    choose(key, replicas) ->  Choice(ranks, reason)      ranks: replica ids, most preferred first

    1. session   a request naming a session goes to the replica bound to it in the affinity table (bound
                 when the session was first routed; after a router restart, found again in the replicas'
                 published session digests); a new or unknown session is bound to the replica with the
                 fewest sessions among those within the imbalance bound (POST /v1/sessions is routed as
                 the new session's first request: the ingress names it)
    2. prefix    a stateless request goes to the replica holding the longest run of its prefix digests
                 (published by the replica, or learned here when a request was routed to it)
    3. load      otherwise power of two choices: two random replicas, the less loaded first

Affinity yields when the preferred replica's load exceeds the least loaded one's by more than `imbalance`:
the request goes by load instead (a session is then rebound where it went). That costs reuse, never
correctness: every request carries its whole conversation, and a replica that does not hold a session adopts
its id empty and recomputes (`ServerConfig.adopt_sessions`).

Load is the router's own count (`Loads`) of requests it sent to a replica and that have not completed, plus
those it chose the replica for within the last `Loads.hold_s` and has not yet sent (requests routed at once
see each other's choices). `Policy` and `Loads` are not thread-safe; the router calls them from its one event
loop.
"""

from __future__ import annotations

import random
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from onnxgen.serve.cluster.keys import RouteKey

MODES = ("affinity", "round_robin", "load")


@dataclass(frozen=True)
class ReplicaState:
    """What the router knows of one replica: `id`, `load` (requests in flight), and the digests of the
    `sessions` it holds and the `prefixes` it has cached, from its last routing stats."""

    id: str
    load: int = 0
    sessions: frozenset[str] = frozenset()
    prefixes: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Choice:
    """`ranks`: replica ids in preference tiers (the router takes the least loaded of the first tier that
    accepts); `reason`: "session", "prefix", "load", "round_robin" or "yield" (affinity gave way to load)."""

    ranks: tuple[tuple[str, ...], ...]
    reason: str


class _Lru:
    """A bounded recency-ordered map."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.items: OrderedDict[str, str] = OrderedDict()

    def get(self, key: str) -> str | None:
        value = self.items.get(key)
        if value is not None:
            self.items.move_to_end(key)
        return value

    def put(self, key: str, value: str) -> None:
        self.items[key] = value
        self.items.move_to_end(key)
        while len(self.items) > self.limit:
            self.items.popitem(last=False)


@dataclass
class Policy:
    """The router's state and decision. `mode`: "affinity" (the rules above), "round_robin" or "load" (power
    of two choices only): the last two are baselines. `imbalance`: how many more requests in flight the
    preferred replica may have than the least loaded before affinity yields. `learned`: prefix digests
    remembered per replica from routing (until its stats say otherwise), at most this many each."""

    mode: str = "affinity"
    imbalance: int = 4
    max_sessions: int = 1 << 20
    learned: int = 1 << 14
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.imbalance < 0:
            raise ValueError(f"imbalance must be >= 0, got {self.imbalance}")
        self.table = _Lru(self.max_sessions)  # session digest -> replica id
        self._learned: dict[str, _Lru] = {}  # replica id -> prefix digests routed there
        self._turn = 0

    # --- state ------------------------------------------------------------------------------------------

    def bound(self, session: str) -> str | None:
        """The replica `session` is bound to (None: unbound)."""
        return self.table.items.get(session)

    def forget_replica(self, replica: str) -> None:
        """Drop what is known of a replica that died or left: its sessions are rebound at their next request."""
        self._learned.pop(replica, None)
        for s in [s for s, r in self.table.items.items() if r == replica]:
            del self.table.items[s]

    def _learn(self, replica: str, prefixes: Iterable[str]) -> None:
        lru = self._learned.setdefault(replica, _Lru(self.learned))
        for p in prefixes:
            lru.put(p, "")

    def _matched(self, r: ReplicaState, prefixes: Sequence[str]) -> int:
        learned = self._learned.get(r.id)
        n = 0
        for p in prefixes:
            if p not in r.prefixes and (learned is None or p not in learned.items):
                break
            n += 1
        return n

    # --- the decision -----------------------------------------------------------------------------------

    def choose(self, key: RouteKey | None, replicas: Sequence[ReplicaState]) -> Choice:
        """The ranks for a request with `key` (None: nothing known of it) among `replicas` (the candidates;
        none: no ranks). Binds a session and learns a stateless request's prefixes where it is sent."""
        if not replicas:
            return Choice((), "load")
        if self.mode == "round_robin":
            self._turn += 1
            return Choice(((replicas[self._turn % len(replicas)].id,),), "round_robin")
        if self.mode == "load" or key is None:
            return self._two_choices(replicas)
        least = min(r.load for r in replicas)
        if key.session is not None:
            return self._session(key.session, replicas, least)
        if key.prefixes:
            best, n = None, 0
            for r in replicas:
                m = self._matched(r, key.prefixes)
                if m > n or (m == n and m > 0 and best is not None and r.load < best.load):
                    best, n = r, m
            if best is not None:
                if best.load - least <= self.imbalance:
                    self._learn(best.id, key.prefixes)
                    rest = tuple(r.id for r in sorted(replicas, key=lambda r: r.load) if r is not best)
                    return Choice(((best.id,), rest) if rest else ((best.id,),), "prefix")
                choice = self._two_choices(replicas, "yield")
            else:
                choice = self._two_choices(replicas)
            self._learn(choice.ranks[0][0], key.prefixes)
            return choice
        return self._two_choices(replicas)

    def _session(self, session: str, replicas: Sequence[ReplicaState], least: int) -> Choice:
        by_id = {r.id: r for r in replicas}
        holder = self.table.get(session)
        if holder not in by_id:  # unbound here: a router restart, or its replica left; ask the replicas
            holder = next((r.id for r in replicas if session in r.sessions), None)
        if holder is not None and by_id[holder].load - least <= self.imbalance:
            self.table.put(session, holder)
            return Choice(((holder,),), "session")
        target = self._fewest_sessions(replicas)
        self.table.put(session, target.id)
        return Choice(((target.id,),), "yield" if holder is not None else "session")

    def _fewest_sessions(self, replicas: Sequence[ReplicaState]) -> ReplicaState:
        """Among the replicas within `imbalance` of the least loaded, the one holding the fewest sessions (as
        it publishes them or as bound here, whichever is more: a balance heuristic), then the less loaded,
        then at random. Sessions last; a difference in load within the bound is momentary."""
        least = min(r.load for r in replicas)
        bound: dict[str, int] = {}
        for r in self.table.items.values():
            bound[r] = bound.get(r, 0) + 1

        def weight(r: ReplicaState) -> tuple[int, int, float]:
            return (
                max(len(r.sessions), bound.get(r.id, 0)),
                r.load,
                self.rng.random(),
            )

        return min((r for r in replicas if r.load - least <= self.imbalance), key=weight)

    def _two_choices(self, replicas: Sequence[ReplicaState], reason: str = "load") -> Choice:
        pair = replicas if len(replicas) <= 2 else self.rng.sample(list(replicas), 2)
        ordered = sorted(pair, key=lambda r: (r.load, self.rng.random()))
        return Choice(tuple((r.id,) for r in ordered), reason)  # a tier each: the choice is kept


class Loads:
    """Requests per replica: `sent` and not `done`, plus `chosen` and not yet sent (for at most `hold_s`:
    a choice the router did not follow expires)."""

    def __init__(self, hold_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.hold_s = hold_s
        self.clock = clock
        self.inflight: Counter[str] = Counter()
        self._chosen: dict[str, deque[float]] = {}

    def __getitem__(self, replica: str) -> int:
        chosen = self._chosen.get(replica)
        if chosen:
            now = self.clock()
            while chosen and now - chosen[0] > self.hold_s:
                chosen.popleft()
        return self.inflight[replica] + (len(chosen) if chosen else 0)

    def chosen(self, replica: str) -> None:
        self._chosen.setdefault(replica, deque()).append(self.clock())

    def sent(self, replica: str) -> None:
        chosen = self._chosen.get(replica)
        if chosen:
            chosen.popleft()
        self.inflight[replica] += 1

    def done(self, replica: str) -> None:
        if self.inflight[replica] > 0:
            self.inflight[replica] -= 1

    def forget(self, replica: str) -> None:
        self.inflight.pop(replica, None)
        self._chosen.pop(replica, None)
