"""Engine statistics: the counters the engine thread records, and the snapshot it publishes.

:class:`StatsRecorder` is fed by LLMEngine (once per step, per abort, expiry and rejection);
:class:`EngineStats` is an immutable-by-convention snapshot for metrics and tests, safe to hand
to other threads (EngineLoop publishes one after every step).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from backend.kv_cache.manager import KVCacheManager, KVCacheStats

if TYPE_CHECKING:
    from backend.engine.schedule_output import SchedulerOutput, StepOutcome
    from backend.engine.scheduler import Scheduler
    from backend.engine.sequence import Sequence


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
    num_rejected: int = 0             # queue_full at admission
    finished: dict[str, int] = field(default_factory=dict)   # choices by finish reason
    # speculative decoding (backend/spec); spec_method "" = off
    spec_method: str = ""
    spec_drafted_tokens: int = 0      # draft tokens verified
    spec_accepted_tokens: int = 0     # of those, accepted
    spec_num_drafts: int = 0          # (sequence, step) pairs that verified drafts

    @property
    def useful_tokens(self) -> int:
        return self.computed_tokens - self.recomputed_tokens

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_drafted_tokens if self.spec_drafted_tokens else 0.0


class StatsRecorder:
    """The engine's monotonic counters (engine thread only)."""

    def __init__(self) -> None:
        self.counters = EngineStats()

    def record_schedule(self, out: "SchedulerOutput") -> None:
        c = self.counters
        c.num_steps += 1
        c.spec_num_drafts += sum(1 for s in out.sampling if s.spec_token_ids)
        for req in out.new_requests:
            c.prompt_tokens += len(req.prompt_token_ids)
            c.cached_prompt_tokens += req.num_cached_tokens

    def record_step(self, outcome: "StepOutcome") -> None:
        c = self.counters
        c.computed_tokens += outcome.computed_tokens
        c.recomputed_tokens += outcome.recomputed_tokens
        c.generation_tokens += outcome.generated_tokens
        c.spec_drafted_tokens += outcome.drafted_tokens
        c.spec_accepted_tokens += outcome.accepted_tokens
        self.record_finished(outcome.finished)

    def record_rejected(self) -> None:
        self.counters.num_rejected += 1

    def record_aborted(self) -> None:
        self.counters.num_aborted += 1

    def record_deadline_exceeded(self) -> None:
        self.counters.num_deadline_exceeded += 1

    def record_finished(self, seqs: list["Sequence"]) -> None:
        finished = self.counters.finished
        for seq in seqs:
            reason = seq.finish_reason or "abort"
            finished[reason] = finished.get(reason, 0) + 1

    def snapshot(self, scheduler: "Scheduler", kv: KVCacheManager) -> EngineStats:
        kv_stats = kv.stats()
        return replace(self.counters, num_running=len(scheduler.running), num_waiting=scheduler.num_waiting,
                       num_requests=len(scheduler.requests), kv_usage=kv_stats.usage, kv=kv_stats,
                       num_preemptions=scheduler.num_preemptions, finished=dict(self.counters.finished))
