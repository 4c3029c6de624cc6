"""Prometheus metrics of the engine model, exported on Triton's metrics port: the response
thread's recorder (``LatencyRecorder``) and the metrics thread (``ServingMetrics``).

Each custom-metric update is a blocking IPC round trip from the Python-backend stub to the server,
so nothing on the hot path touches a metric: the recorder collects one response-thread step's typed
events (per-request timings, finishes, rejections) and puts them on a queue as one batch
(``record``); this module's thread applies them (counter events of a batch summed into one
increment per label), and polls the engine loop's stats snapshot every ``poll_interval`` seconds
for the token counters (only changed values are written: they change every step), so those are at
most that stale; the gauges (running, waiting, KV usage) are polled after every batch too. Time to
first token and inter-token latency describe streams only; queue time is observed once per request.

The metric objects come from a ``factory`` (the model.py adapter wraps ``pb_utils.MetricFamily``;
tests pass a fake) with ``counter(name, doc, labels)``, ``gauge(...)`` and
``histogram(name, doc, labels, buckets)`` returning objects with ``increment`` / ``set`` /
``observe``. Every name is listed in docs/architecture.md ("Metrics").
"""
from __future__ import annotations

import bisect
import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from backend.outputs import STOP, StepDelta
from backend.serving.errors import WIRE_KINDS
from backend.serving.lora_metrics import AdapterMetrics, AdapterUse

if TYPE_CHECKING:
    from backend.serving.intake import RequestHandle

log = logging.getLogger(__name__)

_LAT = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
_LONG = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]

HISTOGRAMS: dict[str, tuple[str, list[float]]] = {
    "llm_time_to_first_token_seconds": ("Arrival to first streamed token", _LONG),
    "llm_inter_token_latency_seconds": ("Time between streamed tokens (per token)", _LAT),
    "llm_e2e_request_latency_seconds": ("Arrival to the final response", _LONG),
    "llm_queue_time_seconds": ("Arrival to first schedule", _LONG),
    "llm_abort_to_free_seconds": ("Cancel or abort seen to the request's KV blocks freed", _LAT),
}
TTFT, ITL, E2E, QUEUE, ABORT_TO_FREE = HISTOGRAMS       # their names, in that order
GAUGES: dict[str, str] = {
    "llm_num_requests_running": "Sequences holding KV blocks",
    "llm_num_requests_waiting": "Sequences waiting to be scheduled (new or preempted)",
    "llm_kv_cache_usage_ratio": "Fraction of device KV blocks in use",
    "llm_engine_healthy": "1 while the engine loop runs, 0 after it died (requests get [unavailable])",
}
# counter name -> (doc, how to read it from an EngineStats snapshot)
STAT_COUNTERS: dict[str, tuple[str, Callable[[Any], float]]] = {
    "llm_prompt_tokens_total": ("Prompt tokens of admitted requests", lambda s: s.prompt_tokens),
    "llm_generation_tokens_total": ("Generated tokens", lambda s: s.generation_tokens),
    "llm_prefix_cache_queries_total": ("Prompt tokens looked up in the prefix cache", lambda s: s.kv.prefix_queried_tokens),
    "llm_prefix_cache_hits_total": ("Prompt tokens found in the prefix cache", lambda s: s.kv.prefix_hit_tokens),
    "llm_num_preemptions_total": ("Sequences preempted under KV pressure", lambda s: s.num_preemptions),
    "llm_requests_aborted_total": ("Requests aborted (client cancel, abort request, deadline, shutdown)",
                                   lambda s: s.num_aborted + s.num_deadline_exceeded),
    "llm_kv_cache_evictions_total": ("Cached KV blocks evicted from the device pool", lambda s: s.kv.evictions),
    "llm_kv_offload_out_bytes_total": ("KV bytes written to the offload tiers", lambda s: s.kv.offload_out_bytes),
    "llm_kv_offload_in_bytes_total": ("KV bytes read back from the offload tiers", lambda s: s.kv.offload_in_bytes),
    # speculative decoding (docs/speculative.md): acceptance rate = accepted / draft
    "llm_spec_decode_num_draft_tokens_total": ("Draft tokens verified (speculative decoding)", lambda s: s.spec_drafted_tokens),
    "llm_spec_decode_num_accepted_tokens_total": ("Draft tokens accepted (speculative decoding)", lambda s: s.spec_accepted_tokens),
}
FINISHED = "llm_requests_finished_total"
FINISH_REASONS = ("stop", "length", "abort", "error")
REJECTED = "llm_requests_rejected_total"
REJECT_KINDS = WIRE_KINDS                   # the wire tags: a deadline is "unavailable"


@dataclass(frozen=True, slots=True)
class Observe:
    """One histogram observation (seconds)."""
    name: str
    seconds: float


@dataclass(frozen=True, slots=True)
class Finished:
    """A choice finished with ``reason`` (one of FINISH_REASONS)."""
    reason: str


@dataclass(frozen=True, slots=True)
class Rejected:
    """A request was rejected at admission; ``kind`` is its wire kind (one of REJECT_KINDS)."""
    kind: str


MetricEvent = Observe | Finished | Rejected | AdapterUse


class LatencyRecorder:
    """Response thread only (``metrics`` is a ServingMetrics, or None: timings still computed)."""

    def __init__(self, metrics: Any = None) -> None:
        self.metrics = metrics
        self.pending: list[MetricEvent] = []

    def _add(self, event: MetricEvent) -> None:
        if self.metrics is not None:
            self.pending.append(event)

    def delta(self, h: RequestHandle, d: StepDelta, now: float) -> float | None:
        """Record a delta about to be sent; returns the request's time to first token so far."""
        if d.new_token_ids and h.stream:
            if h.first_token is None:
                h.first_token = now
                self._add(Observe(TTFT, now - h.arrival))
            prev = h.last_token.get(d.index)
            if prev is not None:            # per token: a merged delta carries several
                self._add(Observe(ITL, (now - prev) / len(d.new_token_ids)))
            h.last_token[d.index] = now
        first = not h.queue_time_seen and bool(d.new_token_ids or d.completion_tokens)
        if first:
            h.queue_time_seen = True
            self._add(Observe(QUEUE, d.queue_time))
        if h.lora is not None and (first or d.new_token_ids):
            # per adapter: a request once, at its first scheduled step's delta, and the tokens sent
            self._add(AdapterUse(h.lora, requests=int(first), tokens=len(d.new_token_ids)))
        return None if h.first_token is None else h.first_token - h.arrival

    def completed(self, h: RequestHandle, now: float) -> None:
        """The request's last choice ended normally (stop or length) and its FINAL went out."""
        self._add(Observe(E2E, now - h.arrival))

    def finished(self, reason: str) -> None:
        self._add(Finished(reason))

    def rejected(self, kind: str) -> None:
        self._add(Rejected(kind))

    def abort_freed(self, seconds: float) -> None:
        self._add(Observe(ABORT_TO_FREE, seconds))

    def flush(self) -> None:
        """Hand this step's events to the metrics thread in one queue put."""
        if self.pending:
            events, self.pending = self.pending, []
            self.metrics.record(events)


@dataclass(frozen=True, slots=True)
class Flush:
    """Apply everything queued before it and poll the stats once, then set ``done``."""
    done: threading.Event


# Histograms observed once per streamed response: a pb_utils ``observe`` each would be a blocking IPC
# round trip per response with the GIL held (~7 % of a decode core). Kept here as bucket counts and
# written at the stats poll under Prometheus's histogram series names (``<name>_bucket{le=...}``,
# ``_sum``, ``_count``), which ``histogram_quantile`` and the load harness read.
COUNTED_HISTOGRAMS = frozenset({ITL})


class CountedHistogram:
    """A histogram observed locally (no IPC) and written by ``flush`` (metrics thread) as gauges
    holding the cumulative values (Triton suffixes counter families with ``_total``, which would
    rename the series): only the changed ones, one ``set`` each."""

    def __init__(self, factory: Any, name: str, doc: str, labels: dict[str, str], buckets: list[float]) -> None:
        self.bounds = list(buckets)
        les = [format(b, "g") for b in self.bounds] + ["+Inf"]
        self._bucket = [factory.gauge(f"{name}_bucket", doc, {**labels, "le": le}) for le in les]
        self._sum = factory.gauge(f"{name}_sum", doc, labels)
        self._count = factory.gauge(f"{name}_count", doc, labels)
        self._counts = [0] * len(les)        # per bucket (not cumulative) since the start
        self._total = 0.0
        self._written: list[float | None] = [None] * (len(les) + 2)    # buckets, sum, count

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self._total += value

    def flush(self) -> None:
        values, cumulative = [], 0
        for n in self._counts:
            cumulative += n
            values.append(float(cumulative))
        values += [self._total, float(cumulative)]
        for i, (metric, v) in enumerate(zip(self._bucket + [self._sum, self._count], values)):
            if self._written[i] != v:
                metric.set(v)
                self._written[i] = v


class ServingMetrics:
    def __init__(self, factory: Any, *, stats: Callable[[], Any], healthy: Callable[[], bool],
                 labels: dict[str, str] | None = None, poll_interval: float = 0.1,
                 adapters: Callable[[], dict[str, tuple[int, int]]] | None = None) -> None:
        """``adapters``: the LoRA registry's per-adapter (loads, evictions) (LoRARegistry.counts), or None."""
        labels = dict(labels or {})
        self._factory = factory             # keeps pb_utils MetricFamily objects alive
        self._hist = {n: CountedHistogram(factory, n, doc, labels, buckets) if n in COUNTED_HISTOGRAMS
                      else factory.histogram(n, doc, labels, buckets) for n, (doc, buckets) in HISTOGRAMS.items()}
        self._counted = [self._hist[n] for n in HISTOGRAMS if n in COUNTED_HISTOGRAMS]
        self._gauge = {n: factory.gauge(n, doc, labels) for n, doc in GAUGES.items()}
        self._stat_counter = {n: factory.counter(n, doc, labels) for n, (doc, _) in STAT_COUNTERS.items()}
        self._finished = {r: factory.counter(FINISHED, "Finished choices by finish reason",
                                             {**labels, "reason": r}) for r in FINISH_REASONS}
        self._rejected = {k: factory.counter(REJECTED, "Requests rejected at admission by error tag",
                                             {**labels, "reason": k}) for k in REJECT_KINDS}
        self._stats_fn = stats
        self._adapters = AdapterMetrics(factory, labels, adapters or dict)   # LoRA (lora_metrics.py)
        self._poll_adapters = adapters is not None
        self._healthy_fn = healthy
        self._last_counts = {n: 0.0 for n in STAT_COUNTERS}
        self._last_gauges: dict[str, float] = {}
        self._q: queue.Queue = queue.Queue()
        self._poll_interval = poll_interval
        self._thread = threading.Thread(target=self._run, name="llm-metrics", daemon=True)
        self._thread.start()

    # -- any thread (cheap) ----------------------------------------------------------------
    def record(self, events: list[MetricEvent]) -> None:
        """Queue a batch of events (one put, however many events)."""
        self._q.put(events)

    def observe(self, name: str, seconds: float) -> None:
        self._q.put([Observe(name, seconds)])

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until every queued event and a fresh stats poll are applied (tests, shutdown)."""
        done = threading.Event()
        self._q.put(Flush(done))
        done.wait(timeout)

    def stop(self) -> None:
        self._q.put(STOP)
        self._thread.join(5.0)

    # -- metrics thread --------------------------------------------------------------------
    def _run(self) -> None:
        # The stats are polled every ``poll_interval`` (and at Flush / STOP), never per batch: the token
        # counters change every step, so that wrote them (an IPC round trip each) per step and stream.
        next_poll = time.monotonic() + self._poll_interval
        while True:
            try:
                item = self._q.get(timeout=max(0.0, next_poll - time.monotonic()))
            except queue.Empty:
                item = None
            if item is STOP:
                self._safe_poll()
                return
            if item is not None:
                try:
                    if isinstance(item, Flush):
                        self._safe_poll()
                        next_poll = time.monotonic() + self._poll_interval
                        item.done.set()
                        continue
                    self._apply(item)
                except Exception:           # noqa: BLE001 - a metric must never take serving down
                    log.exception("metric update %r failed", item)
            if time.monotonic() >= next_poll:
                self._safe_poll()
                next_poll = time.monotonic() + self._poll_interval
            elif item is not None and self._q.empty():
                self._safe_poll(full=False)     # the request gauges stay current (see _poll)

    def _apply(self, events: list[MetricEvent]) -> None:
        finished: Counter = Counter()
        rejected: Counter = Counter()
        adapter_requests: Counter = Counter()
        adapter_tokens: Counter = Counter()
        for e in events:
            if isinstance(e, Observe):
                self._hist[e.name].observe(max(0.0, float(e.seconds)))
            elif isinstance(e, Finished):
                finished[e.reason] += 1
            elif isinstance(e, AdapterUse):
                adapter_requests[e.lora] += e.requests
                adapter_tokens[e.lora] += e.tokens
            else:
                rejected[e.kind if e.kind in self._rejected else "internal"] += 1
        if adapter_requests:
            self._adapters.used(adapter_requests, adapter_tokens)
        for reason, n in finished.items():  # one increment (one IPC round trip) per label and batch
            if reason in self._finished:
                self._finished[reason].increment(n)
        for kind, n in rejected.items():
            self._rejected[kind].increment(n)

    def _safe_poll(self, full: bool = True) -> None:
        try:
            self._poll(full)
        except Exception:                   # noqa: BLE001
            log.exception("polling engine stats failed")

    def _poll(self, full: bool = True) -> None:
        """Write the changed values. ``full=False`` (after each batch): only the gauges, which
        change when a request starts or ends or a block fills (so a scrape right after a first
        token or a final sees them); the token counters change every step and wait for the
        interval's full poll."""
        s = self._stats_fn()
        healthy = self._healthy_fn()
        gauges = {"llm_num_requests_running": s.num_running, "llm_num_requests_waiting": s.num_waiting,
                  "llm_kv_cache_usage_ratio": s.kv_usage, "llm_engine_healthy": 1.0 if healthy else 0.0}
        for name, value in gauges.items():
            if self._last_gauges.get(name) != value:
                self._gauge[name].set(float(value))
                self._last_gauges[name] = value
        if not full:
            return
        for h in self._counted:
            h.flush()
        if self._poll_adapters:
            self._adapters.poll()
        for name, (_, read) in STAT_COUNTERS.items():
            value = float(read(s))
            diff = value - self._last_counts[name]
            if diff > 0:
                self._stat_counter[name].increment(diff)
                self._last_counts[name] = value
