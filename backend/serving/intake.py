"""Intake: turn one request copied out of execute() into messages for the response thread.

Runs on Triton's execute thread and never blocks on the engine or on a send: it validates the
request parameters, registers the request (``Opened``) before handing it to the EngineLoop, and
turns any failure into one ``Rejected`` message. A request with parameter ``abort_request_id`` and
no ``input_ids`` is an explicit abort of that request, answered once the engine applied it.
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Callable

from backend.errors import EngineError, invalid_request, unavailable
from backend.outputs import StepDelta
from backend.serving.errors import as_engine_error
from backend.serving.messages import ControlAnswered, DeltaArrived, Incoming, Opened, Rejected, RequestHandle
from backend.serving.request_params import fit_context, parse_parameters, request_settings
from backend.serving.response_thread import ResponseThread
from backend.serving.tombstones import AbortTombstones

log = logging.getLogger(__name__)


class Intake:
    def __init__(self, loop: Any, responses: ResponseThread, tombstones: AbortTombstones, *,
                 max_model_len: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.loop = loop
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
        target = params.get("abort_request_id")
        if target not in (None, ""):
            self._control(str(target), inc.responder, now)
            return
        if inc.input_ids is None:
            raise invalid_request("input_ids", "input_ids is required (or the abort_request_id parameter)")
        if not self.accepting:
            raise unavailable("the server is shutting down")
        settings = request_settings(params)
        fit_context(settings, len(inc.input_ids), self.max_model_len, "input_ids")
        h.remaining, h.stream = settings.sampling.n, settings.stream
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
                         stream=settings.stream, salt=settings.tenant, priority=settings.priority,
                         deadline=deadline)

    def _control(self, target: str, responder: Any, now: float) -> None:
        self.tombstones.leave(target)
        fut = self.loop.abort(target)
        fut.add_done_callback(lambda f: self.responses.post(ControlAnswered(target, responder, now, f)))
