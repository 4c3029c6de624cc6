"""Tenant fairness in the scheduler: per-tenant running caps, and aging of waiting requests.

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
import time
from collections import Counter
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from backend.engine.scheduler import Scheduler
    from backend.engine.sequence import Sequence


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
