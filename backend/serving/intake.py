"""Intake: turn one request copied out of execute() into messages for the response thread.

Runs on Triton's execute thread and never blocks on the engine or on a send: it reads the
request parameters (the one place the server reads them: request_params.py), registers the
request (``Opened``) before handing it to the EngineLoop, and turns any failure into one
``Rejected`` message. A request with parameter ``abort_request_id`` and
no ``input_ids`` is an explicit abort of that request, answered once the engine applied it.

A structured-output request whose grammar is not compiled yet waits for it off this thread
(backend/structured/compiler.py ``prepare_async``: a worker thread with a budget); it enters the
engine when the grammar is ready, from the worker's callback, or gets its 400.
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Callable

from backend import protocol as P
from backend.engine.roles import takes_handover
from backend.errors import EngineError, invalid_request, unavailable
from backend.outputs import StepDelta
from backend.serving import lora_control
from backend.serving.errors import as_engine_error
from backend.serving.messages import ControlAnswered, DeltaArrived, Incoming, Opened, Rejected, RequestHandle
from backend.serving.request_params import cache_salt, fit_context, parse_parameters, request_settings
from backend.serving.response_thread import ResponseThread
from backend.serving.tombstones import AbortTombstones
from backend import timing
from common import env

log = logging.getLogger(__name__)


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
        timing.mark(h.rid, "eng.submit")

    def _control(self, target: str, responder: Any, now: float, tenant: str) -> None:
        """An abort stops only a request of the caller's own tenant (the ``tenant`` parameter)."""
        self.tombstones.leave(target)
        fut = self.loop.abort(target, tenant=tenant)
        fut.add_done_callback(lambda f: self.responses.post(ControlAnswered(target, responder, now, f)))
