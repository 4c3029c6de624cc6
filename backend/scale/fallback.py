"""When a request for the primary model is served by the lighter fallback model instead.

Opt-in only (the request or its key asks for it): a fallback answer comes from a different model,
so a client that did not ask keeps today's behaviour (it waits, or gets 429 when the queue is full).
An opted-in request degrades when the primary has no healthy replica, or when the primary is
saturated: its ongoing requests per replica are past ``max_ongoing_per_replica`` (the queue-time
threshold expressed in requests, which the router can read without asking the replicas).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FallbackPolicy:
    max_ongoing_per_replica: float = 8.0

    def use_fallback(self, *, opted_in: bool, healthy_replicas: int, ongoing: int,
                     fallback_available: bool) -> str | None:
        """The reason to degrade ("no_healthy_primary" | "primary_saturated"), or None."""
        if not (opted_in and fallback_available):
            return None
        if healthy_replicas <= 0:
            return "no_healthy_primary"
        if ongoing / healthy_replicas > self.max_ongoing_per_replica:
            return "primary_saturated"
        return None
