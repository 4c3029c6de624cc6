"""EngineLoop: runs LLMEngine.step() on its own daemon thread, fed by a thread-safe intake queue.

    submit(...) ──► intake queue ──► [engine thread: apply adds/aborts → step() → sinks]
    abort(id)   ──►      ↑                         │
    stats()     ◄── snapshot published after every step

Only the engine thread touches the engine. ``submit`` validates synchronously, so callers get
admission errors (EngineError) at once, without reading engine state: validation is a pure
function of the limits captured at startup (admission.py), and the waiting bound is checked
against the loop's own count (adds not applied yet + what the engine thread last saw waiting),
kept under the loop's lock. Adds and aborts are applied between steps, so an aborted request's
blocks are free before the next step runs. When idle the thread blocks on the intake queue (no
busy spin). If a step raises, every open request gets a final StepDelta with
``finish_reason="error"`` and an internal EngineError, and the loop stops, unhealthy.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from backend.engine.admission import check_queue, duplicate_id, validate_request
from backend.engine.embedding import validate_embed
from backend.engine.roles import StepEngine
from backend.errors import EngineError, internal, queue_full, unavailable
from backend.outputs import STOP, StepDelta
from backend.pooling_params import PoolingParams
from backend.engine.admission import SamplingParams
from common import env

if TYPE_CHECKING:
    from backend.engine.admission import TenantFairness
    from backend.engine.llm_engine import EngineStats

log = logging.getLogger(__name__)
Sink = Callable[[StepDelta], object] | queue.Queue[StepDelta]


# -- what the intake queue carries (one stop sentinel) -------------------------------------
@dataclass(slots=True)
class AddRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    salt: str | None
    priority: int
    deadline: float | None
    pooling: PoolingParams | None = None     # an embedding request (engine/embedding.py)


@dataclass(slots=True)
class AbortRequest:
    request_id: str
    freed: Future[float | None]   # the time.monotonic() instant the blocks were freed, or None


_CRASH = object()            # tests: makes the engine thread raise (EngineLoop.inject_crash)
IDLE_AUDIT_DELAY_S = 0.02     # the allocator audit runs once the loop has been idle this long
FIRST_TOKEN_HANDOFF_S = 0.0001  # s the engine thread yields after dispatching a first token
# A benchmark's hook (bench/ttft_trace.py), None in the product: (request id, event, monotonic time or None: now)
trace: Callable[[str, str, float | None], None] | None = None


@dataclass(slots=True)
class _Open:
    """A submitted request until its last choice's final delta went to the sink."""
    sink: Sink
    remaining: int           # choices not final yet
    tenant: str = ""


ENGINE_NICE_ENV = "TRITON_LLM_ENGINE_NICE"


def set_thread_nice(value: int | str) -> None:
    """The calling thread's nice value; best effort (unprivileged, it cannot be lowered)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), int(value))
    except (OSError, ValueError) as exc:
        log.debug("thread nice %s not applied: %s", value, exc)


def _apply_engine_nice() -> None:
    """On the engine thread: its nice value from ``TRITON_LLM_ENGINE_NICE`` when set (the engine stub's default: the
    stack's other processes then preempt the step's pool worker, whose chunks it takes over, not the engine thread)."""
    value = env.raw(ENGINE_NICE_ENV)
    if value:
        set_thread_nice(value)


class EngineLoop:
    def __init__(self, engine: StepEngine, *, name: str = "engine-loop", fairness: TenantFairness | None = None,
                 max_open_per_tenant: int = 0) -> None:
        self.engine = engine
        # Tenant fairness (admission.py): the scheduler's hook, and the per-tenant bound on open requests checked at submit
        self.fairness = fairness
        if fairness is not None:
            engine.scheduler.fairness = fairness
        self.max_open_per_tenant = max_open_per_tenant
        self._per_tenant: dict[str, int] = {}
        self.limits = engine.limits              # immutable: safe to read from any thread
        self.grammars = getattr(engine, "grammars", None)   # structured outputs' compile cache (thread-safe)
        self.healthy = True
        self.error: EngineError | None = None
        self._intake: queue.Queue[object] = queue.Queue()   # AddRequest, AbortRequest, STOP, _CRASH
        self._lock = threading.Lock()            # guards the three fields below
        self._open: dict[str, _Open] = {}
        self._queued = 0                        # adds submitted but not applied yet
        self._engine_waiting = 0                # sequences waiting in the engine, as last seen
        self._accepting = True
        self._stats = engine.stats()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- any thread ------------------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams | None = None, *,
               sink: Sink, stream: bool = True, salt: str | None = None, priority: int = 0,
               deadline: float | None = None, tenant: str | None = None,
               pooling: PoolingParams | None = None) -> None:
        """Queue a request; its StepDeltas go to ``sink``. Raises EngineError synchronously:
        invalid_request, queue_full, unavailable. ``pooling``: an embedding request (one final delta)."""
        if not self.healthy:
            raise unavailable(f"engine is not healthy: {self.error}")
        if not self._accepting:
            raise unavailable("engine is shutting down")
        params = params or SamplingParams()
        prompt_ids = list(prompt_ids)
        if pooling is not None:                 # the model's pooling config is fixed at startup too
            validate_embed(self.limits, self.engine.pooling_config, request_id, prompt_ids, pooling)
            params = SamplingParams()           # one choice, nothing sampled
        else:
            validate_request(self.limits, request_id, prompt_ids, params)
            if self.grammars is not None and params.constrained:    # a bad schema is a 400 here;
                self.grammars.prepare(params)                       # compiled once, cached
        tenant = tenant or ""
        with self._lock:
            if request_id in self._open:
                raise duplicate_id(request_id)
            check_queue(self.limits, self._engine_waiting + self._queued)
            if self.max_open_per_tenant and self._per_tenant.get(tenant, 0) >= self.max_open_per_tenant:
                raise queue_full(f"tenant {tenant!r} has {self.max_open_per_tenant} requests open "
                                 "(max_running_per_tenant + max_waiting_per_tenant)", retry_after=1.0)
            self._open[request_id] = _Open(sink, params.n, tenant)
            self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
            self._queued += 1
        if self.fairness is not None:
            self.fairness.register(request_id, tenant)
        self._intake.put(AddRequest(request_id, prompt_ids, params, stream, salt, priority, deadline, pooling))

    def abort(self, request_id: str, tenant: str | None = None) -> Future[float | None]:
        """Abort between steps. The future resolves to the time.monotonic() instant the request's
        blocks were freed, or None if it was not open (already finished or unknown). With
        ``tenant`` given, only a request of that tenant is aborted (another's counts as unknown)."""
        fut: Future[float | None] = Future()
        if tenant is not None:
            with self._lock:
                entry = self._open.get(request_id)
            if entry is not None and entry.tenant != (tenant or ""):
                fut.set_result(None)
                return fut
        if not self._thread.is_alive():          # stopped or crashed: nothing is open any more
            fut.set_result(None)
        else:
            self._intake.put(AbortRequest(request_id, fut))
        return fut

    def inject_crash(self) -> None:
        """Tests only (guarded by the caller): the engine thread raises before its next step."""
        self._intake.put(_CRASH)

    def stats(self) -> EngineStats:
        """The snapshot published after the last step (safe from any thread)."""
        return self._stats

    @property
    def num_open(self) -> int:
        return len(self._open)

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting; with ``drain`` let open requests finish (up to ``timeout``), then
        abort what is left and join the thread."""
        self._accepting = False
        deadline = None if timeout is None else time.monotonic() + timeout
        while drain and self._open and self._thread.is_alive():
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        self._intake.put(STOP)
        self._thread.join(None if deadline is None else max(0.1, deadline - time.monotonic()))

    # -- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        _apply_engine_nice()
        try:
            audit_due = False
            while True:
                idle = not engine.has_unfinished()
                if not self._apply_intake(block=idle, timeout=IDLE_AUDIT_DELAY_S if audit_due else None):
                    for rid in list(self._open):
                        engine.abort_request(rid)
                    self._dispatch(engine.step() if engine.has_unfinished() else [])
                    return
                if engine.has_unfinished():
                    t0 = time.monotonic() if trace is not None else 0.0
                    deltas = engine.step()
                    if trace is not None:
                        for d in deltas:
                            if d.new_token_ids:
                                trace(d.request_id, "loop.step0", t0)
                                trace(d.request_id, "loop.tok0", None)
                    self._publish()            # before the sinks, which may take their time
                    self._dispatch(deltas)
                    if any(d.new_token_ids and d.completion_tokens == len(d.new_token_ids) for d in deltas):
                        # A first token: let the response thread take the GIL and start its send
                        # now, not when the next step's Python part reaches its C call (~0.3 ms of
                        # scheduling later). Once per request; the step waits this long.
                        time.sleep(FIRST_TOKEN_HANDOFF_S)
                    audit_due = audit_due or not engine.has_unfinished()
                elif audit_due:
                    # Idle for IDLE_AUDIT_DELAY_S (not at once: a back-to-back next request would
                    # wait): audit the allocator (O(blocks), ~2 ms for 5k blocks); a broken
                    # invariant stops the loop unhealthy instead of serving from a corrupt pool.
                    audit_due = False
                    engine.kv.check_integrity()
        except BaseException as exc:        # noqa: BLE001 - the loop must report every failure
            self._fail(internal(f"engine step failed: {type(exc).__name__}: {exc}"))

    def _publish(self) -> None:
        """After a step: the stats snapshot and the waiting count that submit() checks."""
        self._stats = stats = self.engine.stats()
        with self._lock:
            self._engine_waiting = stats.num_waiting

    def _apply_intake(self, block: bool, timeout: float | None = None) -> bool:
        """Apply every queued command (waiting for one if ``block``, at most ``timeout`` s);
        False on shutdown."""
        try:
            cmd = self._intake.get(timeout=timeout) if block else self._intake.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd is STOP:
                return False
            if cmd is _CRASH:
                raise RuntimeError("injected engine fault (test_fault=crash_engine)")
            if isinstance(cmd, AddRequest):
                self._add(cmd)
            elif isinstance(cmd, AbortRequest):
                found = self.engine.abort_request(cmd.request_id)
                cmd.freed.set_result(time.monotonic() if found else None)
            try:
                cmd = self._intake.get_nowait()
            except queue.Empty:
                return True

    def _add(self, cmd: AddRequest) -> None:
        if trace is not None:
            trace(cmd.request_id, "loop.add", None)
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt_ids, cmd.params, stream=cmd.stream,
                                    salt=cmd.salt, priority=cmd.priority, deadline=cmd.deadline, pooling=cmd.pooling)
        except EngineError as exc:        # queue_full: preemptions filled the queue since submit
            self._dispatch([StepDelta(cmd.request_id, index, [], [], 0, finished=True, finish_reason="error",
                                      error=exc) for index in range(cmd.params.n)])
        with self._lock:
            self._queued -= 1
            self._engine_waiting = self.engine.scheduler.num_waiting

    def _dispatch(self, deltas: list[StepDelta]) -> None:
        for d in deltas:
            entry = self._open.get(d.request_id)
            if entry is None:
                continue
            if d.finished:
                entry.remaining -= 1
                if entry.remaining == 0:
                    with self._lock:
                        self._open.pop(d.request_id, None)
                        left = self._per_tenant.get(entry.tenant, 1) - 1
                        if left > 0:
                            self._per_tenant[entry.tenant] = left
                        else:
                            self._per_tenant.pop(entry.tenant, None)
                    if self.fairness is not None:
                        self.fairness.forget(d.request_id)
            try:
                sink = entry.sink
                sink.put(d) if isinstance(sink, queue.Queue) else sink(d)
            except Exception:               # a broken sink means the client is gone
                log.exception("sink of request %s failed; aborting it", d.request_id)
                if not d.finished:
                    self.engine.abort_request(d.request_id)

    def _fail(self, error: EngineError) -> None:
        log.error("engine loop stopped: %s", error)
        self.healthy = False
        self.error = error
        self._accepting = False
        try:
            deltas = self.engine.fail_all(error)
        except Exception:                   # noqa: BLE001
            deltas = []
        self._dispatch(deltas)
        for rid, entry in list(self._open.items()):   # anything the engine lost track of
            self._dispatch([StepDelta(rid, i, [], [], 0, finished=True, finish_reason="error", error=error)
                            for i in range(entry.remaining)])
        while True:                         # answer aborts queued behind the crash
            try:
                cmd = self._intake.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, AbortRequest):
                cmd.freed.set_result(None)
