"""The plain-Python half of the decoupled ``engine`` model: intake, response thread, aborts, health.

    execute() ─► Intake.submit ─► EngineLoop.submit ─► [engine thread] ─► sink
                    │ Opened / Rejected / ControlAnswered              │ DeltaArrived
                    ▼                                                   ▼
              response queue ─────────────────────────────────► ResponseThread:
                                                                  coalesce, send(), FINAL once,
                                                                  is_cancelled() on a time basis,
                                                                  latency batch ─► metrics thread

``execute()`` never blocks on the engine or on a send: it only enqueues. Its side is here
(:class:`Intake`); the other pieces, one job each: ``messages.py`` (the typed messages),
``response_thread.py`` (sends and FINAL), ``hold_policy.py`` (fewer sends), ``cancel_watch.py``
(cancels, explicit aborts and aborts that overtake their request), ``metrics.py`` (per-request
timings on the response thread, one batch per step to the metrics thread).

Intake turns one request copied out of execute() into messages for the response thread. It runs
on Triton's execute thread and never blocks on the engine or on a send: it reads the request
parameters (the one place the server reads them: request_params.py), registers the request
(``Opened``) before handing it to the EngineLoop, and turns any failure into one ``Rejected``
message. A request with parameter ``abort_request_id`` and no ``input_ids`` is an explicit abort
of that request, answered once the engine applied it. A structured-output request whose grammar is
not compiled yet waits for it off this thread (backend/structured/compiler.py ``prepare_async``: a
worker thread with a budget); it enters the engine when the grammar is ready, from the worker's
callback, or gets its 400.
"""
from __future__ import annotations

import logging
import queue
import time
import uuid
from typing import Any, Callable

from backend import protocol as P
from backend.engine.roles import takes_handover
from backend.errors import EngineError, invalid_request, unavailable
from backend.outputs import StepDelta
from backend.serving import lora_control
from backend.serving.cancel_watch import CANCEL_CHECK_INTERVAL, AbortTombstones
from backend.serving.errors import as_engine_error
from backend.serving.hold_policy import BUSY_HOLD_MAX, BUSY_HOLD_STEPS
from backend.serving.messages import ControlAnswered, DeltaArrived, Incoming, Opened, Rejected, RequestHandle
from backend.serving.request_params import cache_salt, fit_context, parse_parameters, request_settings
from backend.serving.response_thread import ResponseThread
from common import env

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
                             allow_client_salt=allow_client_salt, test_faults=test_faults)
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

    def submit(self, inc: Incoming) -> None:
        """execute() thread: never blocks; the request is answered from the response thread."""
        self.intake.submit(inc)

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


class Intake:
    def __init__(self, loop: Any, responses: ResponseThread, tombstones: AbortTombstones, *,
                 max_model_len: int, clock: Callable[[], float] = time.monotonic,
                 allow_client_salt: bool = False, test_faults: bool = False) -> None:
        self.loop = loop
        self.allow_client_salt = allow_client_salt
        # Fault injection for tests: needs the engine option *and* the environment variable.
        self.test_faults = test_faults and env.flag("TRITON_LLM_TEST_FAULTS")
        self.responses = responses
        self.tombstones = tombstones
        self.max_model_len = max_model_len
        self.accepting = True               # False from the start of shutdown
        self._clock = clock

    def submit(self, inc: Incoming) -> None:
        now = self._clock()
        h = RequestHandle(inc.request_id or uuid.uuid4().hex, inc.responder, arrival=now, last_check=now)
        try:
            self._admit(h, inc, now)
        except EngineError as err:
            self.responses.post(Rejected(h, err))
        except Exception as exc:            # noqa: BLE001 - a bug: still exactly one answer
            log.exception("admitting request %s failed", h.rid)
            self.responses.post(Rejected(h, as_engine_error(exc)))

    def _admit(self, h: RequestHandle, inc: Incoming, now: float) -> None:
        params = parse_parameters(inc.parameters)
        if params.get(P.LORA_ADMIN) not in (None, ""):     # load / unload an adapter (lora_control.py)
            lora_control.handle(self.loop, params[P.LORA_ADMIN], h, self.responses.post, now)
            return
        target = params.get(P.ABORT_REQUEST_ID)
        if target not in (None, ""):
            tenant = params.get(P.TENANT)
            self._control(str(target)[:P.MAX_TENANT_CHARS], inc.responder, now,
                          "" if tenant is None else str(tenant))
            return
        if self.test_faults and params.get(P.TEST_FAULT) == "crash_engine":
            self.loop.inject_crash()
        if inc.oversize:
            raise invalid_request("input_ids", f"input_ids has {inc.oversize} tokens; the context window "
                                               f"is {self.max_model_len}")
        if inc.input_ids is None:
            raise invalid_request("input_ids", "input_ids is required (or the abort_request_id parameter)")
        if not self.accepting:
            raise unavailable("the server is shutting down")
        settings = request_settings(params)
        if settings.sampling.lora is not None:     # an evicted adapter is read here, not in a step
            lora_control.warm(self.loop, settings.sampling.lora)
            h.lora = settings.sampling.lora
        fit_context(settings, len(inc.input_ids), self.max_model_len, "input_ids")
        extra = {}
        record = params.get(P.HANDOVER)         # a continuation (prefill/decode disaggregation)
        if record not in (None, ""):
            if not takes_handover(self.loop):
                raise invalid_request(P.HANDOVER, "this engine takes no hand-overs (it is not role=decode)")
            extra["handover"] = str(record)
        if settings.pooling is not None:        # an embedding request: one final, the vector
            extra["pooling"] = settings.pooling
        h.remaining, h.stream = (1 if settings.pooling is not None else settings.sampling.n), settings.stream
        h.want = inc.requested_outputs or None
        h.skip_special_tokens = settings.sampling.skip_special_tokens
        grammars = getattr(self.loop, "grammars", None)
        if grammars is not None and settings.sampling.structured is not None and not extra:
            compiled = grammars.prepare_async(settings.sampling)     # caps / bias errors raise here
            if not compiled.done():
                compiled.add_done_callback(lambda f: self._enter_compiled(h, inc, settings, extra, now, f))
                return
            compiled.result()
        self._enter(h, inc, settings, extra, now)

    def _enter_compiled(self, h: RequestHandle, inc: Incoming, settings: Any, extra: dict, now: float,
                        compiled: Any) -> None:
        """On the grammar worker (or its deadline thread): the request's grammar is ready or failed."""
        try:
            compiled.result()
            if not self.accepting:
                raise unavailable("the server is shutting down")
            self._enter(h, inc, settings, extra, now)
        except EngineError as err:
            self.responses.post(Rejected(h, err))
        except Exception as exc:            # noqa: BLE001 - a bug: still exactly one answer
            log.exception("admitting request %s failed", h.rid)
            self.responses.post(Rejected(h, as_engine_error(exc)))

    def _enter(self, h: RequestHandle, inc: Incoming, settings: Any, extra: dict, now: float) -> None:
        post = self.responses.post
        if self.tombstones.take(h.rid):     # its abort overtook it: answer abort without running
            post(Opened(h))
            for i in range(h.remaining):
                post(DeltaArrived(h, StepDelta(h.rid, i, [], [], 0, finished=True, finish_reason="abort",
                                               prompt_tokens=len(inc.input_ids))))
            return
        timeouts = [t for t in (settings.timeout, inc.timeout_s) if t]
        deadline = now + min(timeouts) if timeouts else None
        post(Opened(h))                     # before the engine can produce a delta for it
        self.loop.submit(h.rid, inc.input_ids, settings.sampling, sink=lambda d: post(DeltaArrived(h, d)),
                         stream=settings.stream, salt=cache_salt(settings, self.allow_client_salt),
                         priority=settings.priority, deadline=deadline, tenant=settings.tenant, **extra)

    def _control(self, target: str, responder: Any, now: float, tenant: str) -> None:
        """An abort stops only a request of the caller's own tenant (the ``tenant`` parameter)."""
        self.tombstones.leave(target)
        fut = self.loop.abort(target, tenant=tenant)
        fut.add_done_callback(lambda f: self.responses.post(ControlAnswered(target, responder, now, f)))


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
        metrics = ServingMetrics(metrics_factory, stats=loop.stats, healthy=lambda: loop.healthy,
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
