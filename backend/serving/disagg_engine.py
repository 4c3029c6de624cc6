"""Prefill/decode roles served through Triton (docs/disaggregation.md): what the engine model runs
when its engine option ``role`` is ``prefill`` or ``decode``.

    role=prefill   EngineLoop(PrefillEngine)  every request is prefilled; at its first token
                   PrefillRole stages the prompt's KV on the connector and the request's Triton
                   stream ends with one final response: finish_reason "handover", no tokens, the
                   Handover record (JSON) under key "handover" of the ``metrics`` output. Requests
                   it keeps (n > 1, structured outputs, a first token that ends them) finish here.
    role=decode    DecodeLoop(DecodeEngine)   a request carrying parameter ``handover`` (the record)
                   is admitted through DecodeRole: its prompt's KV is fetched into this pool (blocks
                   already cached here are not), or recomputed if the transfer fails, and it
                   streams from the first token (the record is validated on intake: a bad one is
                   a 400). A request without a record runs as on a unified engine.

Both wrappers look like an LLMEngine to EngineLoop (``step``, ``add_request``, ``abort_request``,
``has_unfinished``; everything else is the engine's), so the loop, intake and response thread are
the unified ones. Aborts: the prefill engine aborts a request it holds, and for one it has already
handed over releases the staged KV (the front sends the abort to both servers while a hand-over is
in flight); the decode engine aborts a record not admitted yet (its staged KV released) or the
running request. Staged transfers nobody fetches expire after ``kv_staged_ttl_s``. Metrics:
``RoleMetrics`` (backend/serving/disagg_metrics.py).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from backend import protocol as P
from backend.disagg.connector import KVConnector
from backend.disagg.connectors import make_connector
from backend.disagg.decode import DecodeRole, KVPlacer
from backend.disagg.handover import Handover
from backend.disagg.prefill import PrefillRole
from backend.engine.admission import duplicate_id
from backend.engine.engine_loop import EngineLoop
from backend.errors import invalid_request
from backend.outputs import StepDelta

log = logging.getLogger(__name__)


@dataclass
class HandoverDelta(StepDelta):
    """The final delta of a request this prefill engine handed over (no tokens; the record)."""
    handover: str | None = None


class _Wrapped:
    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


# How often the response thread asks Triton whether a role's client went away (IPC round trips
# between the sends): the router (client/disagg_client.py) sends an explicit abort to both servers
# whenever a stream ends early, so once a second is enough, as for the llm ensemble's steps.
# Measured on the decode server (once a second vs every send, one run): ITL p50
# 9.1 -> 8.0 ms, p99 17.5 -> 16.1 ms, tokens/s +5 %; is_cancelled() was 11 % of the response
# thread's samples (py-spy). build_engine_service passes it to the EngineService.
ROLE_CANCEL_CHECK_INTERVAL = 1.0


class PrefillEngine(_Wrapped):
    role_name = "prefill"
    cancel_check_interval = ROLE_CANCEL_CHECK_INTERVAL

    def __init__(self, engine, connector: KVConnector, *, ttl: float = 60.0) -> None:
        super().__init__(engine)
        self.connector = connector
        self.role = PrefillRole(engine, connector)
        self.ttl = ttl
        if hasattr(connector, "serve"):
            connector.serve()                       # TCP: listen before the first hand-over
        connector.start_reaper(ttl)

    def step(self) -> list[StepDelta]:
        deltas = self._engine.step()
        records = self.role.take()
        for rec in records:
            self.role.started.pop(rec.request_id, None)
            deltas.append(HandoverDelta(
                rec.request_id, 0, [], [], 0, finished=True, finish_reason=P.FINISH_HANDOVER,
                prompt_tokens=len(rec.prompt_token_ids), cached_tokens=rec.num_cached_tokens,
                queue_time=rec.queue_time, handover=rec.to_json()))
        if records and self.ttl > 0:
            self.role.forget(self.ttl)
        return deltas

    def abort_request(self, request_id: str) -> bool:
        if self._engine.abort_request(request_id):
            return True
        return self.role.release(request_id)       # handed over already: drop its staged KV

    def queue_depth(self) -> int:
        return self._engine.scheduler.num_waiting

    def close_role(self) -> None:
        self.connector.close()


def name_os_threads() -> int:
    """Give this process's Python threads their names at the OS level too (/proc/self/task/<tid>/comm,
    15 characters): Python 3.11 leaves every thread of a stub named ``triton_python_b``, so neither
    ``top -H`` could tell the engine thread from the response thread."""
    n = 0
    for t in threading.enumerate():
        tid = getattr(t, "native_id", None)
        if tid is None or t is threading.main_thread():
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm", "w") as f:
                f.write(t.name[:15])
            n += 1
        except OSError:
            pass
    return n


ADMIT_PER_STEP = 2                  # hand-overs admitted per decode step while streams are running


class DecodeEngine(_Wrapped):
    role_name = "decode"
    cancel_check_interval = ROLE_CANCEL_CHECK_INTERVAL

    def __init__(self, engine, connector: KVConnector) -> None:
        super().__init__(engine)
        self.connector = connector
        # large hand-overs are fetched and written on the placer thread (on the prefill CPUs under
        # serve --disagg's layouts), not inside a decode step
        self.placer = KVPlacer(connector, engine.kv.storage) if engine.kv.storage is not None else None
        self.role = DecodeRole(engine, connector, self.placer)
        self.records: dict[str, Handover] = {}      # submitted, not applied by the engine thread yet
        self._staged_at: dict[str, float] = {}
        self.handover_seconds: collections.deque = collections.deque(maxlen=4096)   # for RoleMetrics
        self._named = False

    def add_request(self, request_id: str, prompt_token_ids, params=None, **kw) -> None:
        rec = self.records.pop(request_id, None)
        if rec is None:
            return self._engine.add_request(request_id, prompt_token_ids, params, **kw)
        if self.role.holds(request_id) or request_id in self._engine.scheduler.requests:
            self.connector.release(rec.locator, owner=kw.get("salt") or "") if rec.locator else None
            raise duplicate_id(request_id)
        self._staged_at[request_id] = float(rec.extra.get("staged_at", 0.0) or 0.0)
        self.role.submit(rec, salt=kw.get("salt"), priority=kw.get("priority", 0),
                         deadline=kw.get("deadline"))                # the caller's, not the record's

    def has_unfinished(self) -> bool:
        return self._engine.has_unfinished() or self.role.busy()

    def step(self) -> list[StepDelta]:
        if not self._named:
            self._named = True
            name_os_threads()                       # the engine and response threads exist by now
        return self._step()

    def _step(self) -> list[StepDelta]:
        # a burst of records is admitted over several steps, so no single step stalls the streams
        running = self._engine.has_unfinished()
        admitted = self.role.admit_pending(ADMIT_PER_STEP if running else None) if self.role.busy() else []
        if not admitted and not running and self.role.placing:
            self.role.wait_placing(0.005)           # only placements in flight: no busy loop
        if admitted:
            now = time.time()
            for d in admitted:
                t = self._staged_at.pop(d.request_id, None)
                if t:
                    self.handover_seconds.append(max(0.0, now - t))
        return admitted + (self._engine.step() if self._engine.has_unfinished() else [])

    def abort_request(self, request_id: str) -> bool:
        finals = self.role.abort(request_id)         # a record not admitted yet: KV released
        if finals is not None:
            self._staged_at.pop(request_id, None)
            self._engine._finals += finals            # surfaced by the next step()
            return True
        return self._engine.abort_request(request_id)

    def queue_depth(self) -> int:
        return len(self.role.pending) + len(self.role.placing) + self._engine.scheduler.num_waiting

    def close_role(self) -> None:
        if self.placer is not None:
            self.placer.close()
        self.connector.close()


class DecodeLoop(EngineLoop):
    """EngineLoop whose ``submit`` also takes a hand-over record (intake passes ``handover``)."""
    accepts_handover = True

    def submit(self, request_id: str, prompt_ids, params=None, *, handover: str | None = None, **kw) -> None:
        if handover is None:
            return super().submit(request_id, prompt_ids, params, **kw)
        try:                                        # all of it here: the engine thread gets a sound record
            rec = Handover.from_json(handover)
            rec.validate(vocab_size=self.engine.vocab_size, max_model_len=self.engine.limits.max_model_len)
            rec_params = rec.sampling_params()
        except (ValueError, TypeError) as exc:
            raise invalid_request(P.HANDOVER, f"bad hand-over record: {exc}") from None
        if list(rec.prompt_token_ids) != list(prompt_ids):
            raise invalid_request(P.HANDOVER, "the hand-over record's prompt differs from input_ids")
        rec.request_id = request_id
        self.engine.records[request_id] = rec
        try:
            super().submit(request_id, prompt_ids, rec_params, **kw)
        except BaseException:
            self.engine.records.pop(request_id, None)
            if rec.locator is not None:
                self.engine.connector.release(rec.locator, owner=kw.get("salt") or "")
            raise


def build_role(engine, args) -> tuple[Any, type[EngineLoop]]:
    """(the engine as EngineLoop should see it, the loop class) for ``args.role`` (``args``:
    backend.config.DisaggConfig)."""
    connector = make_connector(args)
    if args.role == "prefill":
        return PrefillEngine(engine, connector, ttl=args.kv_staged_ttl_s), EngineLoop
    return DecodeEngine(engine, connector), DecodeLoop
