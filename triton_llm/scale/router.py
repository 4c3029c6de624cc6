"""``PrefixAwareRouter``: PrefixAffinityPolicy as a Ray Serve request router.

Ray Serve runs a router inside every caller holding a DeploymentHandle (here the ingress) and asks
``choose_replicas`` for ranked candidates; it then sends to the first replica of the best rank that
accepts (``max_ongoing_requests``), so a full replica falls through to the next rank by itself.

The request's prefix chain travels in the request dict (``request["route"]``, made by
serve_client.py where the tokenizer is), so the router does no tokenizing on Ray's routing path.
Ray pickles this module by value into every caller, so nothing here may rely on module state being
shared with other imports of it (metrics.py keeps the registry of live routers).

Load is the larger of what this router has in flight on a replica (exact for its own requests, and
counting requests it has chosen a replica for but Ray has not yet sent: a burst of requests is
chosen before the first of them is routed, and without those a burst sharing a system prompt all
went to the one replica holding it) and Ray's cached queue length (covers other callers). ``request["avoid"]`` lists replicas a retry must
not return to first (their tritonserver just failed).
"""
from __future__ import annotations

import time
from collections import Counter

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from triton_llm.scale.metrics import RoutingMetrics, register
from triton_llm.scale.policy import PrefixAffinityPolicy


def route_of(pending: PendingRequest | None) -> tuple[list[str], set[str]]:
    if pending is None:
        return [], set()
    req = pending.args[0] if pending.args else pending.kwargs.get("request")
    if not isinstance(req, dict):
        return [], set()
    return list(req.get("route") or []), set(req.get("avoid") or [])


class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, imbalance: int = 4, max_entries: int = 200_000, min_blocks: int = 2) -> None:
        self.policy = PrefixAffinityPolicy(imbalance=imbalance, max_entries=max_entries, min_blocks=min_blocks)
        self.metrics = register(RoutingMetrics())   # by reference: metrics.py is a plain import
        self.ongoing: Counter[str] = Counter()         # replica unique id -> our open requests
        self.open: dict[str, str] = {}                 # internal request id -> replica unique id
        self.decided: dict[str, tuple[list[str], str]] = {}
        self.chosen: dict[str, tuple[str, float]] = {}  # internal request id -> (replica, when): not yet routed
        self.provisional: Counter[str] = Counter()     # replica unique id -> chosen, not yet routed

    def _load(self, r: RunningReplica) -> int:
        cached = self.replica_queue_len_cache.get(r.replica_id)
        uid = r.replica_id.unique_id
        return max(self.ongoing[uid] + self.provisional[uid], cached or 0)

    def _unchoose(self, internal_id: str) -> None:
        entry = self.chosen.pop(internal_id, None)
        if entry is not None and self.provisional[entry[0]] > 0:
            self.provisional[entry[0]] -= 1

    def _expire(self, max_age_s: float = 30.0) -> None:
        """Choices never routed (the caller gave up first) stop counting after ``max_age_s``."""
        old = time.monotonic() - max_age_s
        for iid in [i for i, (_, at) in self.chosen.items() if at < old]:
            self._unchoose(iid)
            self.decided.pop(iid, None)

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
            iid = pending_request.metadata.internal_request_id
            self._unchoose(iid)                        # chosen again (the first choice was full)
            self._expire()
            self.decided[iid] = (chain, decision.policy)
            self.chosen[iid] = (decision.replica, time.monotonic())
            self.provisional[decision.replica] += 1
        rest = sorted((r for rid, r in by_id.items() if rid != decision.replica),
                      key=lambda r: (r.replica_id.unique_id in avoid, self._load(r)))
        return [[by_id[decision.replica]]] + [[r] for r in rest]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        rid = pending_request.metadata.internal_request_id
        self._unchoose(rid)
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
        self.provisional.pop(replica_id.unique_id, None)
