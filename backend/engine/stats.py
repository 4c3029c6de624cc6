"""EngineStats: one snapshot of the engine's gauges and counters (for metrics and tests)."""
from __future__ import annotations

from dataclasses import dataclass, field

from backend.kv_cache.manager import KVCacheStats


@dataclass
class EngineStats:
    # gauges
    num_running: int = 0              # sequences holding KV blocks
    num_waiting: int = 0              # sequences queued (new or preempted)
    num_requests: int = 0             # open requests
    kv_usage: float = 0.0             # fraction of device KV blocks in use
    kv: KVCacheStats = field(default_factory=KVCacheStats)
    # counters (monotonic)
    num_steps: int = 0
    prompt_tokens: int = 0            # prompt tokens of admitted requests (cached ones included)
    cached_prompt_tokens: int = 0     # of those, served from the prefix cache at first schedule
    generation_tokens: int = 0        # sampled tokens
    computed_tokens: int = 0          # tokens run through the model, recomputation included
    recomputed_tokens: int = 0        # recomputed after a preemption (computed - useful)
    num_preemptions: int = 0
    num_aborted: int = 0              # abort_request calls that found an open request
    num_deadline_exceeded: int = 0
    num_rejected: int = 0             # QueueFullError at admission
    finished: dict[str, int] = field(default_factory=dict)   # choices by finish reason

    @property
    def useful_tokens(self) -> int:
        return self.computed_tokens - self.recomputed_tokens
