"""Admission: which requests can ever run, decided from limits fixed when the engine starts, and in
what order tenants' waiting requests are admitted.

Validation is pure functions over an immutable :class:`EngineLimits`, so any thread may call them
(the Triton execute thread validates through EngineLoop.submit without touching engine state).
Every rejection is an :class:`~backend.errors.EngineError` naming the offending request field.

Tenant fairness (:class:`TenantFairness`): per-tenant running caps, and aging of waiting requests.
The scheduler admits waiting sequences from one heap ordered by ``sort_key`` = (priority,
arrival, ...). Before it admits (one hook at the top of ``Scheduler._admit_waiting``),
:meth:`TenantFairness.before_admit` rewrites that heap:

    waiting heap ──► drop finished entries ──► age: priority - waited / aging_s ──► per tenant,
                     keep the first (cap - running) by the aged order, park the rest ──► heapify

* **Running cap** (``max_running_per_tenant``): a tenant never holds more sequences than its cap,
  so a flood from one tenant cannot fill every seat, and its high-priority requests cannot preempt
  more than that many of the others'. Parked sequences stay waiting (counted in ``num_waiting``)
  and are put back on the next step.
* **Aging** (``priority_aging_s``): a waiting sequence gains one priority level (lower number =
  sooner) per ``aging_s`` seconds waited, so a low-priority request cannot starve forever.
* **Waiting cap** (``max_waiting_per_tenant``) is enforced at admission by the EngineLoop
  (``EngineLoop.submit``), which knows each open request's tenant: ``queue_full`` past it.

Tenants are named per request by ``register`` (the EngineLoop calls it on submit). A request
without a tenant is the tenant ``""``. O(waiting) per step; the waiting queue is bounded.
"""
from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from backend.errors import EngineError, invalid_request, queue_full
from backend.sampling_params import InvalidSamplingParam, SamplingParams

if TYPE_CHECKING:
    from backend.engine.scheduler import Scheduler
    from backend.engine.sequence import Sequence


@dataclass(frozen=True)
class EngineLimits:
    """What the engine can hold; captured once at startup and never changed."""
    vocab_size: int
    max_model_len: int          # context window: the model's, clamped to what the KV pool holds
    max_num_seqs: int
    max_waiting: int


def validate_request(limits: EngineLimits, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams | None) -> int:
    """Raise EngineError(invalid_request) for a request that can never run; return its
    resolved max_tokens (never None)."""
    if not isinstance(request_id, str) or not request_id:
        raise invalid_request("request_id", "request_id must be a non-empty string")
    if params is not None and not isinstance(params, SamplingParams):
        raise invalid_request("parameters", f"sampling params must be SamplingParams, "
                                            f"got {type(params).__name__}")
    params = params or SamplingParams()
    try:
        params.validate()       # the caller may have changed a field after construction
    except InvalidSamplingParam as exc:
        raise invalid_request(exc.param, str(exc)) from None
    n = len(prompt_token_ids)
    if n == 0:
        raise invalid_request("input_ids", "prompt is empty: at least one token is needed")
    vocab = limits.vocab_size
    if not token_ids_ok(prompt_token_ids, vocab):
        raise invalid_request("input_ids", f"prompt token ids must be integers in [0, {vocab})")
    limit = limits.max_model_len
    if n >= limit:
        raise invalid_request("input_ids", f"prompt has {n} tokens, which leaves no room to generate: "
                                           f"max_model_len is {limit} tokens")
    max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
    if n + max_tokens > limit:
        raise invalid_request("max_tokens", f"prompt has {n} tokens and max_tokens is {max_tokens}: "
                                            f"{n + max_tokens} tokens exceed max_model_len of {limit} tokens")
    if params.min_tokens > max_tokens:
        raise invalid_request("min_tokens", f"min_tokens ({params.min_tokens}) must not exceed "
                                            f"max_tokens ({max_tokens})")
    if params.n > limits.max_num_seqs:
        raise invalid_request("n", f"n ({params.n}) exceeds max_num_seqs ({limits.max_num_seqs})")
    return max_tokens


def token_ids_ok(ids: list[int], vocab: int) -> bool:
    """Every id an int (not a bool) in [0, vocab). Plain ints (what every caller passes) are checked
    with C-level passes (the per-id generator was ~20 us per 130-token prompt, twice per request on
    the way to its first token); anything else one by one."""
    if set(map(type, ids)) == {int}:
        return 0 <= min(ids) and max(ids) < vocab
    return all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids)


def check_queue(limits: EngineLimits, num_waiting: int) -> None:
    """Raise EngineError(queue_full) when ``num_waiting`` requests already fill the queue."""
    if num_waiting >= limits.max_waiting:
        # About one running batch's worth of work per max_num_seqs waiting requests.
        retry_after = float(max(1, math.ceil(num_waiting / max(1, limits.max_num_seqs))))
        raise queue_full(f"{num_waiting} requests are waiting (max_waiting={limits.max_waiting})",
                         retry_after=retry_after)


def duplicate_id(request_id: str) -> EngineError:
    return invalid_request("request_id", f"request_id {request_id!r} is already in use")


class TenantFairness:
    def __init__(self, *, max_running_per_tenant: int = 0, aging_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_running = max_running_per_tenant
        self.aging_s = aging_s
        self._clock = clock
        self._tenant: dict[str, str] = {}       # request id -> tenant (engine thread + submit: dict ops)
        self._parked: list[Sequence] = []

    @property
    def active(self) -> bool:
        return self.max_running > 0 or self.aging_s > 0

    # -- request registry --------------------------------------------------------------------
    def register(self, request_id: str, tenant: str | None) -> None:
        self._tenant[request_id] = tenant or ""

    def forget(self, request_id: str) -> None:
        self._tenant.pop(request_id, None)

    def tenant_of(self, seq: Sequence) -> str:
        return self._tenant.get(seq.request.request_id, "")

    # -- the scheduler hook ------------------------------------------------------------------
    def before_admit(self, scheduler: Scheduler) -> None:
        """Rewrite ``scheduler._waiting`` (a heap) as described in the module docstring."""
        if not self.active:
            return
        from backend.engine.sequence import SeqStatus

        waiting = [s for s in scheduler._waiting + self._parked if s.status is SeqStatus.WAITING]
        self._parked = []
        if self.aging_s > 0:
            now = self._clock()
            for s in waiting:
                req = s.request
                aged = req.priority - int((now - req.arrival_time) / self.aging_s)
                s.sort_key = (aged,) + s.sort_key[1:]
        if self.max_running > 0:
            running = Counter(self.tenant_of(s) for s in scheduler.running)
            waiting.sort()
            keep = []
            for s in waiting:
                t = self.tenant_of(s)
                if running[t] < self.max_running:
                    running[t] += 1
                    keep.append(s)
                else:
                    self._parked.append(s)
            waiting = keep
        heapq.heapify(waiting)
        scheduler._waiting = waiting
