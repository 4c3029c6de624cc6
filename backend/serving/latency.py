"""Per-request latency bookkeeping on the response thread, handed to the metrics thread once per step.

Each metric event used to be its own queue put (a lock, a wake-up of the metrics thread) per
token; the recorder collects one response-thread step's events and ``flush()`` posts them as one
batch. Time to first token and inter-token latency describe streams only (a non-streamed request
has one response); queue time is observed once per request, at its first scheduled step.
"""
from __future__ import annotations

from typing import Any

from backend.outputs import StepDelta
from backend.serving.messages import RequestHandle
from backend.serving.metrics import AdapterUse, Finished, MetricEvent, Observe, Rejected

TTFT = "llm_time_to_first_token_seconds"
ITL = "llm_inter_token_latency_seconds"
E2E = "llm_e2e_request_latency_seconds"
QUEUE = "llm_queue_time_seconds"
ABORT_TO_FREE = "llm_abort_to_free_seconds"


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
