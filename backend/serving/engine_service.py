"""The plain-Python half of the decoupled ``engine`` model: assembly, health, drain and shutdown.

    execute() ─► Intake.submit ─► EngineLoop.submit ─► [engine thread] ─► sink
                    │ Opened / Rejected / ControlAnswered              │ DeltaArrived
                    ▼                                                   ▼
              response queue ─────────────────────────────────► ResponseThread:
                                                                  coalesce, send(), FINAL once,
                                                                  is_cancelled() on a time basis,
                                                                  latency batch ─► metrics thread

``execute()`` never blocks on the engine or on a send: it only enqueues. The pieces, one job each:
``intake.py`` (a request's parameters read once, its admission, and the typed messages),
``response_thread.py`` (sends and FINAL), ``hold_policy.py`` (fewer sends), ``cancel_watch.py``
(cancels, explicit aborts and aborts that overtake their request), ``metrics.py`` (per-request
timings on the response thread, one batch per step to the metrics thread). This module builds
them from the engine model's config parameters (:func:`build_engine_service`) and stops them;
a request never runs code here (``EngineService.submit`` is the intake's own ``submit``).
"""
from __future__ import annotations

import functools
import logging
import queue
import time
from typing import Any, Callable

from backend.serving import lora_control
from backend.serving.cancel_watch import CANCEL_CHECK_INTERVAL, AbortTombstones
from backend.serving.hold_policy import BUSY_HOLD_MAX, BUSY_HOLD_STEPS
from backend.serving.intake import Incoming, Intake
from backend.serving.response_thread import ResponseThread

__all__ = ["EngineService", "Incoming", "build_engine_service", "STUB_SWITCH_INTERVAL_S"]

# The engine stub's GIL switch interval (Python's default: 0.005 s), set by its model adapter. The
# engine thread gives up the GIL at every C call (the decode step, torch ops) and wants it back when
# the call returns; the response and metrics threads then hold it for up to the switch interval
# before it changes hands, a stall of the whole step for every stream. 0.5 ms bounds that wait
# (measured with load.overhead_ab --thread-stats).
STUB_SWITCH_INTERVAL_S = 0.0005
log = logging.getLogger(__name__)


class EngineService:
    """``start=False`` leaves the response thread unstarted and ``q`` replaces its queue: tests drive
    ``responses.step()`` with a fake clock and a queue whose waits take no time."""

    def __init__(self, loop: Any, *, max_model_len: int, metrics: Any = None,
                 sweep_interval: float = 0.1, tombstone_ttl: float = 30.0, stream_interval: float = 0.0,
                 cancel_check_interval: float = CANCEL_CHECK_INTERVAL,
                 clock: Callable[[], float] = time.monotonic, start: bool = True,
                 q: queue.Queue | None = None, drain_timeout: float = 30.0, busy_stream_interval: float = 0.0,
                 busy_hold_steps: float = BUSY_HOLD_STEPS, busy_hold_max: float = BUSY_HOLD_MAX,
                 allow_client_salt: bool = False, test_faults: bool = False, detokenizer: Any = None) -> None:
        self.loop = loop
        self.drain_timeout = drain_timeout
        self.metrics = metrics
        self.tombstones = AbortTombstones(tombstone_ttl, clock)
        self.responses = ResponseThread(loop, self.tombstones, metrics=metrics, stream_interval=stream_interval,
                                        busy_stream_interval=busy_stream_interval,
                                        busy_hold_steps=busy_hold_steps, busy_hold_max=busy_hold_max,
                                        sweep_interval=sweep_interval,
                                        cancel_check_interval=cancel_check_interval, clock=clock, q=q,
                                        detokenizer=detokenizer)
        self.intake = Intake(loop, self.responses, self.tombstones, max_model_len=max_model_len, clock=clock,
                             lora=lora_control, allow_client_salt=allow_client_salt, test_faults=test_faults)
        # execute() thread: never blocks; the request is answered from the response thread
        self.submit: Callable[[Incoming], None] = self.intake.submit
        self.drain_watch = None
        if start:
            self.responses.start()

    def watch_drain(self, path: str) -> None:
        """Cut open requests at the deadline the launcher writes to ``path`` (drain_watch.py)."""
        from backend.serving.drain_watch import DrainWatch

        self.drain_watch = DrainWatch(path, self._drain).start()

    def _drain(self, seconds: float) -> None:
        self.intake.accepting = False
        self.loop.shutdown(drain=True, timeout=seconds)    # then aborts what is left: each gets a final
        self.responses.stop()               # sends those finals; anything later is answered inline

    @property
    def healthy(self) -> bool:
        return bool(getattr(self.loop, "healthy", True)) and self.responses.is_alive()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop admitting, let open requests finish (up to ``timeout``, default the engine option
        ``shutdown_drain_s``), abort the rest, FINAL all."""
        self.intake.accepting = False
        try:
            self.loop.shutdown(drain=True, timeout=self.drain_timeout if timeout is None else timeout)
        finally:
            if self.drain_watch is not None:
                self.drain_watch.stop()
            self.responses.stop()
            if self.metrics is not None:
                self.metrics.stop()
            close_role = getattr(getattr(self.loop, "engine", None), "close_role", None)  # disagg: staged KV
            if close_role is not None:
                close_role()


def build_engine_service(model_dir: str, params: dict[str, str], *, metrics_factory: Any = None,
                         labels: dict[str, str] | None = None) -> EngineService:
    """Engine + loop + metrics + service from the engine model's config parameters."""
    from backend.config import EngineArgs, option_names
    from backend.engine.engine_loop import EngineLoop
    from backend.engine.admission import TenantFairness
    from backend.engine.llm_engine import LLMEngine
    from backend.serving.metrics import ServingMetrics
    from backend.serving.postprocess import Postprocessor
    from common import env

    known = option_names()               # the rest are Triton's and the model's own parameters
    args = EngineArgs.from_dict({k: v for k, v in params.items() if k in known})
    serving, tenancy = args.serving, args.tenancy
    engine = LLMEngine(model_dir, args.engine, lora=args.lora)
    loop_cls = EngineLoop
    if args.disagg.role != "unified":    # prefill / decode (backend/serving/disagg_engine.py)
        from backend.serving.disagg_engine import build_role

        engine, loop_cls = build_role(engine, args.disagg)
    fairness = TenantFairness(max_running_per_tenant=tenancy.max_running_per_tenant, aging_s=tenancy.priority_aging_s)
    max_open = 0
    if tenancy.max_running_per_tenant and tenancy.max_waiting_per_tenant:
        max_open = tenancy.max_running_per_tenant + tenancy.max_waiting_per_tenant
    elif tenancy.max_waiting_per_tenant:
        max_open = args.engine.max_num_seqs + tenancy.max_waiting_per_tenant
    loop = loop_cls(engine, fairness=fairness if fairness.active else None, max_open_per_tenant=max_open)
    metrics = None
    if metrics_factory is not None:
        from backend.serving.lora_control import registry_of

        registry = registry_of(loop)
        metrics = ServingMetrics(metrics_factory, stats=loop.stats, healthy=functools.partial(getattr, loop, "healthy"),
                                 labels=labels, adapters=None if registry is None else registry.counts)
        if args.disagg.role != "unified":
            from backend.serving.disagg_metrics import RoleMetrics

            metrics.role_metrics = RoleMetrics(metrics_factory, engine, labels)
    service = EngineService(loop, max_model_len=engine.max_model_len, metrics=metrics,
                            stream_interval=serving.stream_interval, drain_timeout=serving.shutdown_drain_s,
                            busy_stream_interval=serving.busy_stream_interval,
                            busy_hold_steps=serving.busy_hold_steps, busy_hold_max=serving.busy_hold_max,
                            # the disaggregated roles check once a second: their router always
                            # sends the explicit abort to both servers (disagg_engine.py)
                            cancel_check_interval=getattr(engine, "cancel_check_interval", CANCEL_CHECK_INTERVAL),
                            allow_client_salt=tenancy.allow_client_salt,
                            # a test hook, not an option: fault-injection parameters only in tests
                            test_faults=env.flag("TRITON_LLM_TEST_FAULTS"),
                            detokenizer=Postprocessor(model_dir))   # text in the engine (response_thread.py)
    if serving.drain_file:
        service.watch_drain(serving.drain_file)
    return service
