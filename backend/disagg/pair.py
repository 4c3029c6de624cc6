"""DisaggPair: one prefill engine and one decode engine behind one step() (in-process router).

    pair = DisaggPair(prefill_engine, decode_engine, connector)
    pair.add_request(...)          # always to the prefill engine
    deltas = pair.step()           # prefill step -> hand-overs -> decode admission -> decode step

The single-host, single-thread form of the routing the issue asks for: the client sees one
stream per request (the prefill engine's delta for the first token is suppressed; the decode
engine emits it at admission), aborts reach whichever side holds the request, and a request the
prefill engine keeps (n > 1, structured outputs, first token ends it) finishes there. Between
processes the same three calls hold: the front routes a new request to a prefill engine, the
record (Handover.to_json) to a decode engine, and the KV moves over the connector.
"""
from __future__ import annotations

import time
from backend.disagg.connector import KVConnector
from backend.disagg.decode import DecodeRole
from backend.disagg.prefill import PrefillRole
from backend.outputs import StepDelta


class DisaggPair:
    def __init__(self, prefill_engine, decode_engine, connector: KVConnector,
                 decode_connector: KVConnector | None = None):
        """``decode_connector``: the decode side's own connector object (TCP: another process's
        client), defaulting to the same one."""
        self.prefill = prefill_engine
        self.decode = decode_engine
        self.prefill_role = PrefillRole(prefill_engine, connector)
        self.decode_role = DecodeRole(decode_engine, decode_connector or connector)
        # per handed-over request: hand-over began (prefill side) -> first token emitted (decode side)
        self.handover_seconds: list[float] = []
        self._staged_at: dict[str, float] = {}
        self._callers: dict[str, tuple[str | None, int]] = {}   # the decode side takes salt/priority from here

    def add_request(self, request_id: str, prompt_token_ids: list[int], params=None, **kw) -> None:
        if request_id in self.decode.scheduler.requests or request_id in self.decode_role.pending:
            from backend.engine.admission import duplicate_id
            raise duplicate_id(request_id)
        self.prefill.add_request(request_id, prompt_token_ids, params, **kw)
        self._callers[request_id] = (kw.get("salt"), kw.get("priority", 0))   # deadline: the record's

    def abort_request(self, request_id: str) -> bool:
        """Abort wherever the request is: prefill engine, in hand-over, or decode engine."""
        if self.prefill.abort_request(request_id):
            return True
        finals = self.decode_role.abort(request_id)
        if finals is not None:
            self._staged_at.pop(request_id, None)
            self.prefill._finals += finals         # surfaced by the next step()
            return True
        return self.decode.abort_request(request_id)

    def _forget_finished(self) -> None:
        for rid in [r for r in self._callers if r not in self.prefill.scheduler.requests]:
            del self._callers[rid]                 # finished (or aborted) on the prefill engine

    def has_unfinished(self) -> bool:
        return (self.prefill.has_unfinished() or bool(self.decode_role.pending)
                or self.decode.has_unfinished())

    def step(self) -> list[StepDelta]:
        deltas = self.prefill.step()
        for rec in self.prefill_role.take():
            self._staged_at[rec.request_id] = self.prefill_role.started.pop(rec.request_id)
            salt, priority = self._callers.pop(rec.request_id, (None, 0))
            self.decode_role.submit(rec, salt=salt, priority=priority)
        if len(self._callers) > len(self.prefill.scheduler.requests):
            self._forget_finished()
        admitted = self.decode_role.admit_pending()
        now = time.perf_counter()
        for d in admitted:
            t = self._staged_at.pop(d.request_id, None)
            if t is not None:
                self.handover_seconds.append(now - t)
        return deltas + admitted + self.decode.step()
