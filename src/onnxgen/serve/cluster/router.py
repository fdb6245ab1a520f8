"""`AffinityRouter`: Ray Serve's request-router seam around `policy.Policy` (the decision lives there).

Configured on the replicas' deployment (`RequestRouterConfig(request_router_class=
"onnxgen.serve.cluster.router:AffinityRouter", request_router_kwargs={"mode": ..., "imbalance": ...})`), it runs
in the process that holds the deployment's handle (the ingress). For each request it reads the `RouteKey` the
ingress attached (`HttpCall.route`; anything else routes by load: never an exception, cf. ray#64326), each
replica's load (`policy.Loads`: requests this router sent it or just chose it for) and its routing stats (`Replica.
record_routing_stats`: the digests of its sessions and cached prefixes), and returns the policy's ranks.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from onnxgen.serve.cluster.keys import RouteKey
from onnxgen.serve.cluster.policy import Loads, Policy, ReplicaState


def _key(pending: PendingRequest | None) -> RouteKey | None:
    if pending is None or not pending.args:
        return None
    route = getattr(pending.args[0], "route", None)
    return route if isinstance(route, RouteKey) else None


class AffinityRouter(RequestRouter):
    """Session- and prefix-affine routing (see `policy`); `mode` "round_robin" or "load" for baselines."""

    def initialize_state(self, mode: str = "affinity", imbalance: int = 4, **_: Any) -> None:
        self.policy = Policy(mode=mode, imbalance=imbalance)
        self.loads = Loads()
        # replica id -> (its last stats report, held so that `is` compares it, and the report's sets)
        self._stats: dict[str, tuple[dict[str, Any], frozenset[str], frozenset[str]]] = {}

    def _state(self, replica: RunningReplica) -> ReplicaState:
        """What the policy needs of `replica`; its stats' sets are built once per stats report."""
        rid = replica.replica_id.unique_id
        stats: dict[str, Any] = replica.routing_stats or {}
        cached = self._stats.get(rid)
        if cached is None or cached[0] is not stats:
            cached = (stats, frozenset(stats.get("sessions", ())), frozenset(stats.get("prefixes", ())))
            self._stats[rid] = cached
        return ReplicaState(rid, self.loads[rid], cached[1], cached[2])

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # every candidate is considered at once
        states = [self._state(r) for r in candidate_replicas]
        choice = self.policy.choose(_key(pending_request), states)
        if choice.ranks:
            self.loads.chosen(choice.ranks[0][0])
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[i] for i in rank] for rank in choice.ranks]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self.loads.sent(replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self.loads.done(replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget_replica(replica_id.unique_id)
        self.loads.forget(replica_id.unique_id)
        self._stats.pop(replica_id.unique_id, None)
