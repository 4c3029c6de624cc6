"""Routing metrics: decisions by policy (hit = "prefix"), fallbacks, per-replica load.

Counted in plain Python (``snapshot()`` for tests and the ingress's /scale/stats) and, inside a
Ray worker, exported through ``ray.util.metrics`` so Ray's Prometheus endpoint carries them:
``triton_llm_route_decisions{policy}``, ``triton_llm_route_fallbacks{reason}``,
``triton_llm_replica_load{replica}``.
"""
from __future__ import annotations

import threading
from collections import Counter


# The routers' metrics living in this process (the ingress's /scale/stats reads them). Kept here and
# not in router.py: Ray pickles a custom router's module *by value*, so a list there would be a copy.
LIVE: list["RoutingMetrics"] = []


def register(metrics: "RoutingMetrics") -> "RoutingMetrics":
    LIVE.append(metrics)
    return metrics


class RoutingMetrics:
    def __init__(self, export: bool = True) -> None:
        self._lock = threading.Lock()
        self.decisions: Counter[str] = Counter()
        self.fallbacks: Counter[str] = Counter()
        self.loads: dict[str, int] = {}
        self._ray = _ray_metrics() if export else None

    def decided(self, policy: str, loads: dict[str, int]) -> None:
        with self._lock:
            self.decisions[policy] += 1
            self.loads = dict(loads)
        if self._ray:
            self._ray[0].inc(1, tags={"policy": policy})
            for replica, n in loads.items():
                self._ray[2].set(n, tags={"replica": replica})

    def fell_back(self, reason: str) -> None:
        with self._lock:
            self.fallbacks[reason] += 1
        if self._ray:
            self._ray[1].inc(1, tags={"reason": reason})

    def snapshot(self) -> dict:
        with self._lock:
            total = sum(self.decisions.values())
            return {"decisions": dict(self.decisions), "fallbacks": dict(self.fallbacks),
                    "loads": dict(self.loads),
                    "prefix_hit_rate": (self.decisions["prefix"] / total) if total else 0.0}


def _ray_metrics():
    try:
        import ray
        if not ray.is_initialized():
            return None
        from ray.util.metrics import Counter as RCounter, Gauge
    except ImportError:
        return None
    return (RCounter("triton_llm_route_decisions", "routing decisions by policy", tag_keys=("policy",)),
            RCounter("triton_llm_route_fallbacks", "requests served by the fallback model",
                     tag_keys=("reason",)),
            Gauge("triton_llm_replica_load", "ongoing requests per replica as the router sees them",
                  tag_keys=("replica",)))
