"""When a request for the primary model is served by the lighter fallback model instead.

Opt-in only (the request or its key asks for it): a fallback answer comes from a different model,
so a client that did not ask keeps today's behaviour (it waits, or gets 429 when the queue is full).
An opted-in request degrades when

- the primary has no healthy replica (``no_healthy_primary``), or
- the primary is saturated (``primary_saturated``): its ongoing requests per healthy replica are
  past ``max_ongoing_per_replica`` (set it to the engine's running slots, ``max_num_seqs``: past it
  a newcomer queues), or the queue time the primary's engines reported for their latest requests
  (the final response's ``metrics.queue_time``, a decaying maximum) is past ``queue_time_s``.

Both are read where the ingress already is: no polling of replicas on the request path.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class QueueTimeTracker:
    """The primary's recent queue time: the largest reported value, decaying with ``half_life_s`` so
    that one slow request an hour ago does not keep the primary "saturated"."""
    half_life_s: float = 10.0
    _value: float = 0.0
    _at: float = field(default_factory=time.monotonic)

    def observe(self, queue_time_s: float, now: float | None = None) -> None:
        self._value = max(self.current(now), float(queue_time_s))
        self._at = time.monotonic() if now is None else now

    def current(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        return self._value * 0.5 ** (max(0.0, now - self._at) / self.half_life_s)


@dataclass(frozen=True)
class FallbackPolicy:
    max_ongoing_per_replica: float = 8.0
    queue_time_s: float = 2.0

    def use_fallback(self, *, opted_in: bool, healthy_replicas: int, ongoing: int,
                     fallback_available: bool, recent_queue_time_s: float = 0.0) -> str | None:
        """The reason to degrade ("no_healthy_primary" | "primary_saturated"), or None."""
        if not (opted_in and fallback_available):
            return None
        if healthy_replicas <= 0:
            return "no_healthy_primary"
        if ongoing / healthy_replicas > self.max_ongoing_per_replica:
            return "primary_saturated"
        if recent_queue_time_s > self.queue_time_s:
            return "primary_saturated"
        return None
