"""EngineService (the engine model's plain-Python half): FINAL exactly once on every path."""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

import pytest

from backend.outputs import StepDelta
from backend.serving.engine_service import _STOP, EngineService, Incoming


class FakeResponder:
    def __init__(self, cancel_after: int | None = None):
        self.sent: list[tuple] = []         # (outputs, error, final)
        self.cancel_after = cancel_after
        self.checks = 0
        self.done = threading.Event()

    def send(self, outputs=None, *, error=None, final=False):
        assert not any(f for _, _, f in self.sent), "nothing may follow FINAL"
        self.sent.append((outputs, error, final))
        if final:
            self.done.set()

    def is_cancelled(self):
        self.checks += 1
        return self.cancel_after is not None and len(self.sent) >= self.cancel_after

    @property
    def finals(self):
        return sum(f for _, _, f in self.sent)

    def texts(self, key="finish_reason"):
        return [o[key][0].decode() for o, _, _ in self.sent if o is not None]

    def wait(self):
        assert self.done.wait(5), self.sent


class FakeLoop:
    """Records submits; the test pushes deltas into the request's sink by hand."""

    def __init__(self):
        self.healthy = True
        self.sinks: dict[str, object] = {}
        self.submitted: dict[str, dict] = {}
        self.aborts: list[str] = []
        self.raise_on_submit: Exception | None = None

    def submit(self, rid, ids, params, *, sink, **kw):
        if self.raise_on_submit is not None:
            raise self.raise_on_submit
        self.sinks[rid] = sink
        self.submitted[rid] = dict(ids=ids, params=params, **kw)

    def abort(self, rid):
        self.aborts.append(rid)
        fut = Future()
        fut.set_result(time.monotonic() if rid in self.sinks else None)
        return fut

    def shutdown(self, drain=True, timeout=None):
        for rid, sink in self.sinks.items():
            sink(StepDelta(rid, 0, [], [], 0, finished=True, finish_reason="abort"))


def push(svc, rid, d):
    """Hand a delta to the service and let the response thread take it alone: deltas queued
    together are merged (coalesce), which these tests of one-send-per-delta paths must avoid."""
    svc.loop.sinks[rid](d)
    deadline = time.monotonic() + 2
    while not svc._q.empty() and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.02)


def delta(rid, tokens, finished=False, reason=None, index=0, error=None):
    return StepDelta(rid, index, tokens, tokens, 0, finished=finished, finish_reason=reason, error=error,
                     prompt_tokens=3, completion_tokens=len(tokens))


@pytest.fixture
def svc():
    loop = FakeLoop()
    s = EngineService(loop, max_model_len=64, sweep_interval=0.02)
    yield s
    s._q.put(_STOP)


def submit(svc, rid="r", ids=(1, 2, 3), responder=None, **params):
    responder = responder or FakeResponder()
    svc.submit(Incoming(rid, list(ids) if ids is not None else None, params, responder))
    return responder


def test_stream_sends_each_delta_and_final_with_the_last(svc):
    r = submit(svc, max_tokens=5)
    push(svc, "r", delta("r", [7]))
    push(svc, "r", delta("r", [8, 9]))
    push(svc, "r", delta("r", [10], finished=True, reason="length"))
    r.wait()
    assert [f for _, _, f in r.sent] == [False, False, True]
    assert r.texts() == ["", "", "length"]
    assert r.sent[-1][0]["metrics"][0] != b""
    assert svc.loop.submitted["r"]["stream"] is True


def test_n_choices_final_goes_with_the_last_choice(svc):
    r = submit(svc, n=2, stream=False)
    sink = svc.loop.sinks["r"]
    sink(delta("r", [1, 2], finished=True, reason="length", index=1))
    sink(delta("r", [3, 4], finished=True, reason="stop", index=0))
    r.wait()
    assert [(o["index"][0], f) for o, _, f in r.sent] == [(1, False), (0, True)]
    assert svc.loop.submitted["r"]["stream"] is False


@pytest.mark.parametrize("params, ids, tag", [
    ({"max_tokens": 0}, [1], "[invalid_request param=max_tokens]"),
    ({"temperature": "nan"}, [1], "[invalid_request param=temperature]"),
    ({}, [], "[invalid_request param=input_ids]"),
    ({}, None, "[invalid_request param=input_ids]"),
    ({"max_tokens": 100}, [1] * 10, "[invalid_request param=max_tokens]"),
    ({}, [1] * 64, "[invalid_request param=input_ids]"),
])
def test_rejections_are_one_tagged_error_with_final(svc, params, ids, tag):
    r = submit(svc, ids=ids, **params)
    r.wait()
    assert len(r.sent) == 1
    outputs, error, final = r.sent[0]
    assert outputs is None and final and str(error).startswith(tag)


def test_engine_admission_errors_are_tagged(svc):
    from backend.engine.errors import QueueFullError

    svc.loop.raise_on_submit = QueueFullError("3 waiting", retry_after=2)
    r = submit(svc)
    r.wait()
    assert str(r.sent[0][1]).startswith("[queue_full retry_after=2]") and r.sent[0][1].kind == "queue_full"
    svc.loop.raise_on_submit = RuntimeError("[unavailable] engine is not healthy: boom")
    r = submit(svc, rid="r2")
    r.wait()
    assert r.sent[0][1].kind == "unavailable"
    svc.loop.raise_on_submit = ValueError("prompt token ids must be integers in [0, 10)")
    r = submit(svc, rid="r3")
    r.wait()
    assert str(r.sent[0][1]).startswith("[invalid_request param=input_ids]")


def test_client_cancel_aborts_and_sends_one_bare_final(svc):
    r = submit(svc, responder=FakeResponder(cancel_after=1), max_tokens=9)
    push(svc, "r", delta("r", [7]))
    push(svc, "r", delta("r", [8]))  # is_cancelled() is now true: not sent, engine told to abort
    push(svc, "r", delta("r", [9]))  # still running until the abort lands: dropped
    push(svc, "r", delta("r", [], finished=True, reason="abort"))
    r.wait()
    assert svc.loop.aborts == ["r"]
    assert [(o is None, f) for o, _, f in r.sent] == [(False, False), (True, True)]


def test_cancel_of_a_silent_request_is_found_by_the_sweep(svc):
    r = FakeResponder()
    submit(svc, responder=r, stream=False)
    r.cancel_after = 0               # cancelled before any send
    deadline = time.monotonic() + 2
    while not svc.loop.aborts and time.monotonic() < deadline:
        time.sleep(0.01)
    assert svc.loop.aborts == ["r"]
    svc.loop.sinks["r"](delta("r", [], finished=True, reason="abort"))
    r.wait()
    assert r.sent == [(None, None, True)]


def test_engine_error_is_an_error_response_with_final(svc):
    r = submit(svc, n=2)
    sink = svc.loop.sinks["r"]
    sink(delta("r", [5]))
    sink(delta("r", [], finished=True, reason="error", error="[internal] engine step failed: X"))
    sink(delta("r", [], finished=True, reason="error", index=1, error="[internal] engine step failed: X"))
    r.wait()
    assert r.sent[-1][1].kind == "internal" and r.finals == 1
    assert len(r.sent) == 2


def test_deadline_is_an_unavailable_error(svc):
    r = submit(svc, request_timeout=0.5)
    assert svc.loop.submitted["r"]["deadline"] is not None
    svc.loop.sinks["r"](delta("r", [], finished=True, reason="abort", error="deadline exceeded"))
    r.wait()
    assert r.sent[0][1].kind == "unavailable" and "deadline" in str(r.sent[0][1])


def test_explicit_abort_control_request(svc):
    target = submit(svc, rid="t", max_tokens=9)
    ctrl = submit(svc, rid="c", ids=None, abort_request_id="t")
    ctrl.wait()
    assert svc.loop.aborts == ["t"] and ctrl.texts() == ["abort"] and ctrl.finals == 1
    svc.loop.sinks["t"](delta("t", [3], finished=True, reason="abort"))
    target.wait()
    assert target.texts() == ["abort"] and target.finals == 1


def test_abort_that_overtakes_its_request(svc):
    ctrl = submit(svc, rid="c", ids=None, abort_request_id="late")
    ctrl.wait()
    assert ctrl.texts() == [""]
    r = submit(svc, rid="late", n=2)
    r.wait()
    assert "late" not in svc.loop.submitted
    assert r.texts() == ["abort", "abort"] and r.finals == 1


def test_shutdown_finishes_every_open_request(svc):
    r = submit(svc, max_tokens=9)
    svc.shutdown(timeout=1)
    assert r.finals == 1 and r.texts() == ["abort"]
    late = submit(svc, rid="late")
    assert late.sent == [] or late.sent[0][1].kind == "unavailable"


class FakeMetrics:
    def __init__(self):
        self.events = queue.Queue()

    def observe(self, name, v):
        self.events.put(("observe", name))

    def finished(self, reason):
        self.events.put(("finished", reason))

    def rejected(self, kind):
        self.events.put(("rejected", kind))


def test_metric_events():
    loop, m = FakeLoop(), FakeMetrics()
    svc = EngineService(loop, max_model_len=64, metrics=m)
    try:
        r = submit(svc, max_tokens=5)
        push(svc, "r", delta("r", [1]))
        push(svc, "r", delta("r", [2], finished=True, reason="length"))
        r.wait()
        bad = submit(svc, rid="bad", max_tokens=0)
        bad.wait()
        time.sleep(0.05)
        events = []
        while not m.events.empty():
            events.append(m.events.get())
        assert events == [("observe", "llm_time_to_first_token_seconds"), ("observe", "llm_queue_time_seconds"),
                          ("finished", "length"), ("observe", "llm_inter_token_latency_seconds"),
                          ("observe", "llm_e2e_request_latency_seconds"), ("rejected", "invalid_request")]
    finally:
        svc._q.put(_STOP)


def test_stream_interval_gathers_mid_stream_tokens_but_not_the_first():
    loop = FakeLoop()
    svc = EngineService(loop, max_model_len=64, sweep_interval=0.02, stream_interval=0.2)
    try:
        r = submit(svc, max_tokens=9)
        t0 = time.monotonic()
        push(svc, "r", delta("r", [7]))
        assert len(r.sent) == 1 and time.monotonic() - t0 < 0.15   # the first token is not held
        for tok in (8, 9, 10):                                    # arrive within one interval
            loop.sinks["r"](delta("r", [tok]))
            time.sleep(0.02)
        loop.sinks["r"](delta("r", [11], finished=True, reason="length"))
        r.wait()
        ids = [int(t) for o, _, _ in r.sent for t in o["output_ids"]]
        assert ids == [7, 8, 9, 10, 11]
        assert len(r.sent) < 5 and r.finals == 1
    finally:
        svc._q.put(_STOP)


def test_stream_interval_stops_waiting_for_a_final():
    loop = FakeLoop()
    svc = EngineService(loop, max_model_len=64, sweep_interval=0.02, stream_interval=2.0)
    try:
        r = submit(svc, max_tokens=9)
        push(svc, "r", delta("r", [7]))
        loop.sinks["r"](delta("r", [8]))                           # mid-stream: the thread lingers
        time.sleep(0.05)
        t0 = time.monotonic()
        loop.sinks["r"](delta("r", [9], finished=True, reason="length"))
        r.wait()
        assert time.monotonic() - t0 < 1.0                         # not the whole 2 s interval
        assert [int(t) for o, _, _ in r.sent for t in o["output_ids"]] == [7, 8, 9]
    finally:
        svc._q.put(_STOP)
