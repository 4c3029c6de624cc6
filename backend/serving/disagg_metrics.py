"""``RoleMetrics``: the disaggregated roles' metrics on Triton's metrics port (docs/disaggregation.md):
per role, transfer bytes and seconds, hand-overs by outcome, hand-over latency (decode side:
staging on the prefill host to the first token emitted here; wall clocks, so across hosts only as
good as their sync), queue depth and staged transfers."""
from __future__ import annotations

import collections
import logging
import threading
from typing import Any

log = logging.getLogger(__name__)

HANDOVER_SECONDS = "llm_disagg_handover_seconds"
_HO_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
OUTCOMES = {"prefill": ("handed_over", "kept", "staging_failed"),
            "decode": ("admitted", "recomputed", "rejected", "aborted_pending")}


class RoleMetrics:
    """Polls the role's counters every ``interval`` s on its own thread (IPC per metric write)."""

    def __init__(self, factory: Any, role_engine, labels: dict[str, str] | None = None,
                 interval: float = 0.25) -> None:
        self.r = role_engine
        self.role = role_engine.role_name
        lab = {**(labels or {}), "role": self.role}
        c, g = factory.counter, factory.gauge
        self._counters = {
            "bytes": c("llm_disagg_transfer_bytes_total",
                       "KV bytes staged (prefill) or fetched (decode) by the KV connector", lab),
            "seconds": c("llm_disagg_transfer_seconds_total",
                         "Seconds spent staging (prefill) or fetching (decode) KV", lab),
            "expired": c("llm_disagg_staged_expired_total",
                         "Staged KV transfers dropped by the TTL (kv_staged_ttl_s), never fetched", lab),
            "released": c("llm_disagg_staged_released_total",
                          "Staged KV transfers released (abort) before being fetched", lab),
            "prefix": c("llm_disagg_prefix_hit_blocks_total",
                        "KV blocks not fetched because the decode pool had them cached", lab),
        }
        self._outcomes = {o: c("llm_disagg_handovers_total", "Hand-overs by outcome", {**lab, "outcome": o})
                          for o in OUTCOMES[self.role]}
        self._depth = g("llm_disagg_queue_depth",
                        "Requests waiting in this role (decode: records not admitted + waiting)", lab)
        self._staged = g("llm_disagg_staged_transfers", "KV transfers staged here and not yet fetched", lab)
        self._hist = None
        if self.role == "decode":
            self._hist = factory.histogram(HANDOVER_SECONDS, "Prefill-side staging to the first token "
                                           "emitted by the decode engine", lab, _HO_BUCKETS)
        self._last: dict[str, float] = collections.defaultdict(float)
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llm-disagg-metrics", daemon=True)
        self._thread.start()

    def values(self) -> dict[str, float]:
        st = self.r.connector.stats()
        role = self.r.role
        if self.role == "prefill":
            v = {"bytes": st.staged_bytes, "seconds": st.stage_seconds, "handed_over": role.handed_over,
                 "kept": role.kept, "staging_failed": role.staging_failures, "prefix": 0}
        else:
            ds = role.stats
            v = {"bytes": st.fetched_bytes, "seconds": st.fetch_seconds, "admitted": ds.admitted,
                 "recomputed": ds.recomputed, "rejected": ds.rejected, "aborted_pending": ds.aborted_pending,
                 "prefix": ds.prefix_hit_blocks}
        v.update(expired=st.expired, released=st.released)
        return v

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.poll()
            except Exception:                       # noqa: BLE001 - metrics never take serving down
                log.exception("disaggregation metrics poll failed")

    def poll(self) -> None:
        for key, value in self.values().items():
            diff = float(value) - self._last[key]
            if diff > 0:
                metric = self._counters.get(key) or self._outcomes.get(key)
                if metric is not None:
                    metric.increment(diff)
                self._last[key] = float(value)
        for name, gauge, value in (("depth", self._depth, self.r.queue_depth()),
                                   ("staged", self._staged, self.r.connector.num_staged())):
            if self._last.get("g_" + name) != value:
                gauge.set(float(value))
                self._last["g_" + name] = value
        ho = getattr(self.r, "handover_seconds", None)
        while ho and self._hist is not None:
            self._hist.observe(ho.popleft())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
