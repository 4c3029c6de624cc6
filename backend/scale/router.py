"""``PrefixAwareRouter``: PrefixAffinityPolicy as a Ray Serve request router.

Ray Serve runs a router inside every caller holding a DeploymentHandle (here the ingress) and asks
``choose_replicas`` for ranked candidates; it then sends to the first replica of the best rank that
accepts (``max_ongoing_requests``), so a full replica falls through to the next rank by itself.

The request's prefix chain travels in the request dict (``request["route"]``, made by
serve_client.py where the tokenizer is), so the router does no tokenizing on Ray's routing path.
Ray pickles this module by value into every caller, so nothing here may rely on module state being
shared with other imports of it (metrics.py keeps the registry of live routers).

Load is the larger of what this router has in flight on a replica (exact for its own requests) and
Ray's cached queue length (covers other callers). ``request["avoid"]`` lists replicas a retry must
not return to first (their tritonserver just failed).
"""
from __future__ import annotations

from collections import Counter

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from backend.scale.metrics import RoutingMetrics, register
from backend.scale.policy import PrefixAffinityPolicy


def route_of(pending: PendingRequest | None) -> tuple[list[str], set[str]]:
    if pending is None:
        return [], set()
    req = pending.args[0] if pending.args else pending.kwargs.get("request")
    if not isinstance(req, dict):
        return [], set()
    return list(req.get("route") or []), set(req.get("avoid") or [])


class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, imbalance: int = 4, max_entries: int = 200_000) -> None:
        self.policy = PrefixAffinityPolicy(imbalance=imbalance, max_entries=max_entries)
        self.metrics = register(RoutingMetrics())   # by reference: metrics.py is a plain import
        self.ongoing: Counter[str] = Counter()         # replica unique id -> our open requests
        self.open: dict[str, str] = {}                 # internal request id -> replica unique id
        self.decided: dict[str, tuple[list[str], str]] = {}

    def _load(self, r: RunningReplica) -> int:
        cached = self.replica_queue_len_cache.get(r.replica_id)
        return max(self.ongoing[r.replica_id.unique_id], cached or 0)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        chain, avoid = route_of(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        usable = {rid: self._load(r) for rid, r in by_id.items() if rid not in avoid} or \
            {rid: self._load(r) for rid, r in by_id.items()}
        decision = self.policy.choose(chain, usable)
        if pending_request is not None:
            self.decided[pending_request.metadata.internal_request_id] = (chain, decision.policy)
        rest = sorted((r for rid, r in by_id.items() if rid != decision.replica),
                      key=lambda r: (r.replica_id.unique_id in avoid, self._load(r)))
        return [[by_id[decision.replica]]] + [[r] for r in rest]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        rid = pending_request.metadata.internal_request_id
        chain, policy = self.decided.pop(rid, ([], "least_loaded"))
        self.policy.record(chain, replica_id.unique_id)
        self.ongoing[replica_id.unique_id] += 1
        self.open[rid] = replica_id.unique_id
        self.metrics.decided(policy, {k: v for k, v in self.ongoing.items()})

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rep = self.open.pop(internal_request_id, None)
        if rep is not None and self.ongoing[rep] > 0:
            self.ongoing[rep] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id.unique_id)
        self.ongoing.pop(replica_id.unique_id, None)
