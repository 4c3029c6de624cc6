"""Admission: what a request may ask (:class:`SamplingParams`, its ranges checked at construction),
which requests can ever run, decided from limits fixed when the engine starts, and in what order
tenants' waiting requests are admitted.

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from backend.errors import EngineError, InvalidSamplingParam, invalid_request, queue_full

if TYPE_CHECKING:
    from backend.engine.scheduler import Scheduler
    from backend.engine.sequence import Sequence


@dataclass
class SamplingParams:
    """Per-request generation settings, OpenAI names, validated at construction (ranges); the
    engine's limits are checked by :func:`validate_request`."""
    n: int = 1
    max_tokens: int | None = 16          # None = the rest of the context window
    min_tokens: int = 0
    temperature: float = 1.0             # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                       # 0 or -1 = disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None          # number of top logprobs per token (0 = only the chosen)
    skip_special_tokens: bool = True
    speculative: bool = True             # False: this request never carries draft tokens (opt-out)
    # Structured outputs (backend/structured): a StructuredSpec (JSON schema, regex, choice, grammar,
    # tool calls) and OpenAI's logit_bias {token id: bias in [-100, 100]}.
    structured: Any = None
    logit_bias: dict[int, float] | None = None
    lora: str | None = None              # a LoRA adapter's name (backend/lora); None = the base model

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise InvalidSamplingParam(name, f"{name} {why}")

        def finite(name: str, v: float) -> None:
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                bad(name, f"must be a finite number, got {v!r}")

        if not isinstance(self.n, int) or self.n < 1 or self.n > 16:
            bad("n", f"must be an integer in [1, 16], got {self.n!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"must be a non-negative integer, got {self.min_tokens!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            finite(name, getattr(self, name))
        if self.temperature < 0 or self.temperature > 100:
            bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be -1, 0 or a positive integer, got {self.top_k!r}")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not 0 < self.repetition_penalty <= 2:
            bad("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        if len(self.stop) > 4 or any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be at most 4 non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora or len(self.lora) > 128):
            bad("lora", f"must be an adapter name (1 to 128 characters), got {self.lora!r}")
        if self.constrained:
            from backend.structured.spec import check_structured
            self.logit_bias = check_structured(self.structured, self.logit_bias)

    @property
    def constrained(self) -> bool:
        """The one check of whether structured-output work applies (a spec or a logit_bias):
        requests without either never enter backend/structured."""
        return self.structured is not None or bool(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
        waiting = [s for s in scheduler._waiting + self._parked if s.waiting]
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
