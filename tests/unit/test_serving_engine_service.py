"""EngineService (the engine model's plain-Python half): exact responses, FINAL exactly once.

The response thread is not started: each test posts messages (through the service's intake and
the fake loop's sinks) and runs ``responses.step(0)`` itself, with a fake clock, so what is sent,
when ``is_cancelled()`` is asked and what is batched are exact and need no sleeps.
"""
from __future__ import annotations

import queue
from concurrent.futures import Future

import pytest

from backend.errors import ErrorKind, deadline_exceeded, internal, invalid_request, queue_full, unavailable
from backend.outputs import StepDelta
from backend.serving.engine_service import EngineService, Incoming
from backend.serving.errors import to_wire
from backend.serving.metrics import E2E, ITL, QUEUE, TTFT, Finished, Observe, Rejected

CHECK = 0.02                        # cancel_check_interval
SWEEP = 0.1                         # sweep_interval


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class FakeResponder:
    def __init__(self):
        self.sent: list[tuple] = []         # (outputs, error, final)
        self.cancelled = False
        self.checks = 0

    def send(self, outputs=None, *, error=None, final=False):
        assert not self.finals, "nothing may follow FINAL"
        self.sent.append((outputs, error, final))

    def is_cancelled(self):
        self.checks += 1
        return self.cancelled

    @property
    def finals(self):
        return sum(f for _, _, f in self.sent)

    def ids(self):
        return [[int(t) for t in o["output_ids"]] for o, _, _ in self.sent if o is not None]

    def reasons(self):
        return [o["finish_reason"][0].decode() for o, _, _ in self.sent if o is not None]

    def flags(self):
        return [(o is None, e is None, f) for o, e, f in self.sent]


class FakeLoop:
    """The EngineLoop contract: sinks per request, abort futures, shutdown finishes what is open."""

    def __init__(self, clock):
        self.clock = clock
        self.healthy = True
        self.sinks: dict[str, object] = {}
        self.submitted: dict[str, dict] = {}
        self.aborts: list[str] = []
        self.running: set[str] = set()
        self.raise_on_submit: Exception | None = None
        self.accepting = True

    def submit(self, rid, ids, params, *, sink, **kw):
        if not self.accepting:
            raise unavailable("engine is shutting down")
        if self.raise_on_submit is not None:
            raise self.raise_on_submit
        self.sinks[rid] = sink
        self.running.add(rid)
        self.submitted[rid] = dict(ids=ids, params=params, **kw)

    def emit(self, rid, d):
        if d.finished:
            self.running.discard(rid)
        self.sinks[rid](d)

    def abort(self, rid, tenant=None):
        self.aborts.append(rid)
        fut = Future()
        fut.set_result(self.clock() + 0.001 if rid in self.running else None)
        return fut

    def shutdown(self, drain=True, timeout=None):
        self.accepting = False
        for rid in list(self.running):
            self.emit(rid, StepDelta(rid, 0, [], [], 0, finished=True, finish_reason="abort"))


class FakeMetrics:
    def __init__(self):
        self.batches: list[list] = []
        self.stopped = False

    def record(self, events):
        self.batches.append(list(events))

    def observe(self, name, seconds):
        self.batches.append([Observe(name, seconds)])

    def stop(self):
        self.stopped = True


def delta(rid, tokens, finished=False, reason=None, index=0, error=None):
    return StepDelta(rid, index, tokens, tokens, 0, finished=finished, finish_reason=reason, error=error,
                     prompt_tokens=3, completion_tokens=len(tokens), queue_time=0.5)


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def svc(clock):
    return make_service(clock)


def make_service(clock, **kw):
    kw = dict(max_model_len=64, sweep_interval=SWEEP, cancel_check_interval=CHECK, clock=clock,
              start=False) | kw
    return EngineService(FakeLoop(clock), **kw)


def submit(svc, rid="r", ids=(1, 2, 3), **params):
    responder = FakeResponder()
    svc.submit(Incoming(rid, list(ids) if ids is not None else None, params, responder))
    return responder


def step(svc, dt=0.001):
    """Let ``dt`` seconds pass, then run one response-thread step over everything queued."""
    svc.loop.clock.t += dt
    assert svc.responses.step(0)


def emit(svc, rid, d, dt=0.001):
    svc.loop.emit(rid, d)
    step(svc, dt)


def test_stream_sends_each_delta_and_final_with_the_last(svc):
    r = submit(svc, max_tokens=5)
    step(svc)
    emit(svc, "r", delta("r", [7]))
    emit(svc, "r", delta("r", [8, 9]))
    emit(svc, "r", delta("r", [10], finished=True, reason="length"))
    assert r.ids() == [[7], [8, 9], [10]]
    assert [f for _, _, f in r.sent] == [False, False, True]
    assert r.reasons() == ["", "", "length"]
    assert r.sent[0][0]["metrics"][0] == b"" and b'"ttft": 0.002' in r.sent[-1][0]["metrics"][0]
    assert svc.loop.submitted["r"]["stream"] is True


def test_n_choices_final_goes_with_the_last_choice(svc):
    r = submit(svc, n=2, stream=False)
    svc.loop.emit("r", delta("r", [1, 2], finished=True, reason="length", index=1))
    step(svc)
    assert r.flags() == [(False, True, False)]
    emit(svc, "r", delta("r", [3, 4], finished=True, reason="stop", index=0))
    assert [(o["index"][0], f) for o, _, f in r.sent] == [(1, False), (0, True)]
    assert svc.loop.submitted["r"]["stream"] is False


@pytest.mark.parametrize("params, ids, param", [
    ({"max_tokens": 0}, [1], "max_tokens"),
    ({"temperature": "nan"}, [1], "temperature"),
    ({}, [], "input_ids"),
    ({}, None, "input_ids"),
    ({"max_tokens": 100}, [1] * 10, "max_tokens"),
    ({}, [1] * 64, "input_ids"),
])
def test_rejections_are_one_error_response_with_final(svc, params, ids, param):
    r = submit(svc, ids=ids, **params)
    step(svc)
    (outputs, error, final), = r.sent
    assert outputs is None and final
    assert error.kind is ErrorKind.INVALID_REQUEST and error.param == param
    assert to_wire(error).startswith(f"[invalid_request param={param}] ")
    assert svc.loop.submitted == {}


@pytest.mark.parametrize("raised", [
    queue_full("3 requests are waiting", retry_after=2.0),
    unavailable("engine is not healthy: boom"),
    invalid_request("input_ids", "prompt token ids must be integers in [0, 10)"),
    deadline_exceeded(),
])
def test_engine_admission_errors_go_out_unchanged(svc, raised):
    svc.loop.raise_on_submit = raised
    r = submit(svc)
    step(svc)
    assert r.flags() == [(True, False, True)] and r.sent[0][1] is raised


def test_an_unexpected_admission_failure_is_one_internal_error(svc):
    svc.loop.raise_on_submit = KeyError("oops")
    r = submit(svc)
    step(svc)
    (_, error, final), = r.sent
    assert final and error.kind is ErrorKind.INTERNAL and to_wire(error) == "[internal] KeyError: 'oops'"


def test_cancel_is_checked_on_a_time_basis_not_per_send(svc):
    r = submit(svc, max_tokens=30)
    step(svc, 0)
    for i in range(10):                     # a token every 6 ms: checks at 24 ms and 48 ms only
        emit(svc, "r", delta("r", [i]), dt=0.006)
    assert len(r.sent) == 10 and r.checks == 2


def test_a_cancel_seen_aborts_at_once_and_ends_with_one_bare_final(svc):
    r = submit(svc, max_tokens=9)
    step(svc, 0)
    emit(svc, "r", delta("r", [7]), dt=1.5 * CHECK)    # checked (not cancelled), sent
    r.cancelled = True
    emit(svc, "r", delta("r", [8]), dt=0.5 * CHECK)    # not due for a check: still sent
    assert svc.loop.aborts == [] and r.checks == 1
    emit(svc, "r", delta("r", [9]), dt=0.75 * CHECK)   # due: cancel seen, not sent, engine aborts now
    assert svc.loop.aborts == ["r"] and r.checks == 2
    emit(svc, "r", delta("r", [10]))                   # generated before the abort landed: dropped
    emit(svc, "r", delta("r", [], finished=True, reason="abort"))
    assert r.ids() == [[7], [8]]
    assert r.flags() == [(False, True, False), (False, True, False), (True, True, True)]


def test_cancel_of_a_silent_request_is_found_by_the_sweep(svc):
    r = submit(svc, stream=False)
    step(svc)
    r.cancelled = True
    step(svc, SWEEP / 2)
    assert svc.loop.aborts == []
    step(svc, SWEEP)
    assert svc.loop.aborts == ["r"] and r.sent == []
    emit(svc, "r", delta("r", [], finished=True, reason="abort"))
    assert r.sent == [(None, None, True)]


def test_a_failed_send_stops_the_request_and_still_finals_once(svc):
    r = submit(svc, max_tokens=9)
    step(svc)

    def broken(outputs=None, *, error=None, final=False):
        r.sent.append(("attempt", error, final))
        if outputs is not None:
            raise RuntimeError("stream closed")
    r.send = broken
    emit(svc, "r", delta("r", [7]))
    assert svc.loop.aborts == ["r"]
    emit(svc, "r", delta("r", [], finished=True, reason="abort"))
    assert [f for _, _, f in r.sent] == [False, True]


def test_engine_error_is_one_error_response_and_stops_the_other_choices(svc):
    r = submit(svc, n=2)
    emit(svc, "r", delta("r", [5]))
    boom = internal("engine step failed: X")
    emit(svc, "r", delta("r", [], finished=True, reason="error", error=boom))
    assert svc.loop.aborts == ["r"]
    emit(svc, "r", delta("r", [], finished=True, reason="error", index=1, error=boom))
    assert r.flags() == [(False, True, False), (True, False, True)] and r.sent[1][1] is boom


def test_an_error_finish_without_an_error_is_internal(svc):
    r = submit(svc)
    emit(svc, "r", delta("r", [], finished=True, reason="error"))
    (_, error, final), = r.sent
    assert final and error.kind is ErrorKind.INTERNAL


def test_deadline_is_an_unavailable_error(svc):
    r = submit(svc, request_timeout=0.5)
    assert svc.loop.submitted["r"]["deadline"] == pytest.approx(1000.5)
    late = deadline_exceeded()
    emit(svc, "r", delta("r", [], finished=True, reason="abort", error=late))
    (_, error, final), = r.sent
    assert final and error is late and to_wire(error).startswith("[unavailable] ") and "deadline" in str(error)


def test_explicit_abort_control_request(svc):
    target = submit(svc, rid="t", max_tokens=9)
    ctrl = submit(svc, rid="c", ids=None, abort_request_id="t")
    step(svc)
    assert svc.loop.aborts == ["t"] and ctrl.reasons() == ["abort"] and ctrl.finals == 1
    emit(svc, "t", delta("t", [3], finished=True, reason="abort"))
    assert target.reasons() == ["abort"] and target.finals == 1


def test_abort_that_overtakes_its_request(svc, clock):
    ctrl = submit(svc, rid="c", ids=None, abort_request_id="late")
    step(svc)
    assert ctrl.reasons() == [""] and ctrl.finals == 1
    r = submit(svc, rid="late", n=2)
    step(svc)
    assert "late" not in svc.loop.submitted
    assert r.reasons() == ["abort", "abort"] and [f for _, _, f in r.sent] == [False, True]


def test_a_tombstone_expires(svc):
    submit(svc, rid="c", ids=None, abort_request_id="late")
    step(svc, svc.tombstones.ttl + 1)
    submit(svc, rid="late")
    assert "late" in svc.loop.submitted


def test_abort_after_finish_leaves_no_tombstone(svc):
    first = submit(svc, rid="x", max_tokens=1)
    emit(svc, "x", delta("x", [1], finished=True, reason="length"))
    ctrl = submit(svc, rid="c", ids=None, abort_request_id="x")
    step(svc)
    assert ctrl.reasons() == [""] and first.finals == 1
    del svc.loop.submitted["x"]
    submit(svc, rid="x")                    # the id reused: it runs
    assert "x" in svc.loop.submitted


def test_a_rejected_duplicate_id_does_not_hide_the_running_request(svc):
    running = submit(svc, rid="r", stream=False)
    svc.loop.raise_on_submit = invalid_request("request_id", "request_id 'r' is already in use")
    dup = submit(svc, rid="r")
    step(svc)
    assert dup.flags() == [(True, False, True)]
    running.cancelled = True                # the sweep still watches the first one
    step(svc, SWEEP)
    assert svc.loop.aborts == ["r"]


def test_shutdown_finishes_every_open_request_and_answers_later_ones(svc):
    r = submit(svc, max_tokens=9)
    silent = submit(svc, rid="s")
    svc.loop.running.discard("s")           # the engine lost it: shutdown must still end it
    svc.shutdown(timeout=1)
    assert r.reasons() == ["abort"] and r.finals == 1
    (_, error, final), = silent.sent
    assert final and error.kind is ErrorKind.UNAVAILABLE
    late = submit(svc, rid="late")
    (_, error, final), = late.sent
    assert final and error.kind is ErrorKind.UNAVAILABLE
    ctrl = submit(svc, rid="c", ids=None, abort_request_id="r")
    assert ctrl.reasons() == [""] and ctrl.finals == 1


def test_metric_events_go_out_once_per_step(clock):
    m = FakeMetrics()
    svc = make_service(clock, metrics=m)
    a, b = submit(svc, rid="a", max_tokens=5), submit(svc, rid="b", max_tokens=5)
    step(svc, 0)
    svc.loop.emit("a", delta("a", [1]))
    svc.loop.emit("b", delta("b", [1]))
    step(svc, 0.25)
    assert m.batches == [[Observe(TTFT, 0.25), Observe(QUEUE, 0.5)] * 2]
    svc.loop.emit("a", delta("a", [2, 3], finished=True, reason="length"))
    svc.loop.emit("b", delta("b", [2], finished=True, reason="stop"))
    bad = submit(svc, rid="bad", temperature="nan")
    step(svc, 0.5)
    assert m.batches[1] == [Finished("length"), Observe(ITL, 0.25), Observe(E2E, 0.75),
                            Finished("stop"), Observe(ITL, 0.5), Observe(E2E, 0.75), Rejected("invalid_request")]
    assert len(m.batches) == 2 and a.finals == b.finals == bad.finals == 1
    step(svc)
    assert len(m.batches) == 2              # nothing new: nothing posted


class ScriptedQueue(queue.Queue):
    """Waits take no real time: a wait advances the fake clock to the next scheduled arrival (if it
    comes before the wait's end) and delivers it, else to the wait's end, and times out."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock
        self.arrivals: list[list] = []      # [seconds after the previous arrival, what arrives]
        self.waits: list[float] = []

    def get(self, block=True, timeout=None):
        if self.qsize() or not block or not timeout:
            return super().get(block, timeout)
        self.waits.append(round(timeout, 6))
        if self.arrivals and self.arrivals[0][0] <= timeout:
            after, arrive = self.arrivals.pop(0)
            self.clock.t += after
            arrive()
            return super().get_nowait()
        self.clock.t += timeout
        if self.arrivals:
            self.arrivals[0][0] -= timeout
        raise queue.Empty


def gathering_service(clock, interval):
    q = ScriptedQueue(clock)
    return make_service(clock, stream_interval=interval, q=q), q


def test_stream_interval_gathers_mid_stream_tokens_but_not_the_first(clock):
    svc, q = gathering_service(clock, 0.15)
    r = submit(svc, max_tokens=9)
    step(svc)
    emit(svc, "r", delta("r", [7]))
    assert r.ids() == [[7]]                               # the first token went at once
    for t in (8, 9, 10):                                  # a step every 40 ms: held
        emit(svc, "r", delta("r", [t]), dt=0.04)
    assert r.ids() == [[7]]
    assert svc.responses.step(SWEEP)                      # the steps stalled: the wait ends at the
    assert q.waits == [0.07] and r.ids() == [[7], [8, 9, 10]]     # held tokens' deadline
    assert [f for _, _, f in r.sent] == [False, False]
    emit(svc, "r", delta("r", [11], finished=True, reason="length"))
    assert r.ids()[-1] == [11] and r.finals == 1          # a final is never held


def test_the_next_step_after_the_deadline_carries_the_held_tokens(clock):
    svc, q = gathering_service(clock, 0.05)
    r = submit(svc, max_tokens=20)
    emit(svc, "r", delta("r", [1]))
    for t in range(2, 8):                                 # a step every 30 ms: every other one sends
        emit(svc, "r", delta("r", [t]), dt=0.03)
    assert r.ids() == [[1], [2, 3], [4, 5], [6, 7]] and q.waits == []


def test_steps_slower_than_the_interval_are_never_held(clock):
    svc, q = gathering_service(clock, 0.05)
    r = submit(svc, max_tokens=20)
    for t in range(1, 6):
        emit(svc, "r", delta("r", [t]), dt=0.06)
    assert r.ids() == [[1], [2], [3], [4], [5]] and svc.responses._holding == {}


def test_a_final_takes_the_held_tokens_with_it(clock):
    svc, q = gathering_service(clock, 2.0)
    r = submit(svc, max_tokens=9)
    emit(svc, "r", delta("r", [7]))
    emit(svc, "r", delta("r", [8]))
    emit(svc, "r", delta("r", [9], finished=True, reason="length"))
    assert r.ids() == [[7], [8, 9]] and r.reasons() == ["", "length"] and r.finals == 1
    assert svc.responses._holding == {} and q.waits == []


def test_a_stop_string_cut_is_not_merged_the_held_tokens_go_first(clock):
    svc, _ = gathering_service(clock, 2.0)
    r = submit(svc, max_tokens=9)
    emit(svc, "r", delta("r", [7]))
    emit(svc, "r", delta("r", [8]))
    cut = StepDelta("r", 0, [9], [9], 0, max_chars=0, finished=True, finish_reason="stop")
    emit(svc, "r", cut)
    assert r.ids() == [[7], [8], [9]] and [f for _, _, f in r.sent] == [False, False, True]


def test_an_abort_final_is_not_merged_the_held_tokens_go_first(clock):
    svc, _ = gathering_service(clock, 2.0)
    r = submit(svc, max_tokens=9)
    emit(svc, "r", delta("r", [7]))
    emit(svc, "r", delta("r", [8]))
    emit(svc, "r", delta("r", [], finished=True, reason="abort"))
    assert r.ids() == [[7], [8], []] and r.reasons() == ["", "", "abort"] and r.finals == 1


def test_an_error_sends_the_held_tokens_first(clock):
    svc, _ = gathering_service(clock, 2.0)
    r = submit(svc, max_tokens=9)
    emit(svc, "r", delta("r", [7]))
    emit(svc, "r", delta("r", [8]))
    boom = internal("engine step failed")
    emit(svc, "r", delta("r", [], finished=True, reason="error", error=boom))
    assert r.ids() == [[7], [8]] and r.flags()[-1] == (True, False, True) and r.sent[-1][1] is boom


def test_a_cancel_drops_the_held_tokens(clock):
    svc, _ = gathering_service(clock, 2.0)
    r = submit(svc, max_tokens=9)
    emit(svc, "r", delta("r", [7]))
    emit(svc, "r", delta("r", [8]))
    r.cancelled = True
    emit(svc, "r", delta("r", [9]), dt=SWEEP)             # due for a check: cancel seen
    assert svc.loop.aborts == ["r"] and svc.responses._holding == {}
    emit(svc, "r", delta("r", [], finished=True, reason="abort"))
    assert r.ids() == [[7]] and r.flags()[-1] == (True, True, True) and r.finals == 1


def test_choices_are_held_apart_and_shutdown_sends_what_is_held(clock):
    svc, _ = gathering_service(clock, 2.0)
    r = submit(svc, max_tokens=9, n=2)
    svc.loop.emit("r", delta("r", [1], index=0))
    svc.loop.emit("r", delta("r", [5], index=1))
    step(svc)
    svc.loop.emit("r", delta("r", [2], index=0))
    svc.loop.emit("r", delta("r", [6], index=1))
    step(svc)
    svc.loop.emit("r", delta("r", [3], index=0))
    step(svc)
    assert r.ids() == [[1], [5]]
    svc.loop.running.discard("r")                         # cut by the shutdown: held tokens still go
    svc.shutdown(timeout=1)
    assert sorted(r.ids()) == [[1], [2, 3], [5], [6]] and r.flags()[-1] == (True, False, True)
    assert r.sent[-1][1].kind is ErrorKind.UNAVAILABLE and r.finals == 1


def test_busy_stream_interval_holds_only_while_many_requests_are_open(clock):
    svc = make_service(clock, busy_stream_interval=0.05)
    svc.responses.hold.busy_streams = 2
    a = submit(svc, rid="a", max_tokens=20)
    emit(svc, "a", delta("a", [1]))
    emit(svc, "a", delta("a", [2]))                       # one open request: each token goes alone
    assert a.ids() == [[1], [2]] and svc.responses.hold_interval() == 0.0
    b = submit(svc, rid="b", max_tokens=20)
    emit(svc, "b", delta("b", [1]))                       # a first token: never held
    assert svc.responses.hold_interval() == 0.05
    svc.loop.emit("a", delta("a", [3]))
    svc.loop.emit("b", delta("b", [2]))
    step(svc)
    assert a.ids() == [[1], [2]] and b.ids() == [[1]]     # both held
    svc.loop.emit("a", delta("a", [4]))
    svc.loop.emit("b", delta("b", [3]))
    step(svc, 0.05)
    assert a.ids() == [[1], [2], [3, 4]] and b.ids() == [[1], [2, 3]]
    svc.responses.hold.stream_interval = 0.2                   # an explicit stream_interval wins
    assert svc.responses.hold_interval() == 0.2


def test_busy_hold_grows_with_the_open_streams_up_to_twice(clock):
    """About the same responses per second at any load: the hold scales with the open requests
    past busy_streams, capped at BUSY_SCALE_MAX times busy_stream_interval."""
    svc = make_service(clock, busy_stream_interval=0.05, **STEP_HOLD)
    svc.responses.hold.busy_streams = 2
    holds, responders = [], []
    for i in range(6):
        responders.append(submit(svc, rid=f"r{i}", max_tokens=20))
        step(svc)
        holds.append(svc.responses.hold_interval())
    assert holds == pytest.approx([0.0, 0.05, 0.075, 0.1, 0.1, 0.1])
    emit(svc, "r0", delta("r0", [1]))                     # a first token: sent
    emit(svc, "r0", delta("r0", [2]), dt=0.04)            # steps 40 ms apart (2.5 gaps: 0.1 s)
    emit(svc, "r0", delta("r0", [3]), dt=0.04)            # 0.08 s after it: held at 6 open (0.1 s)
    assert responders[0].ids() == [[1]]
    emit(svc, "r0", delta("r0", [4]), dt=0.04)            # 0.12 s after the last send: all go
    assert responders[0].ids() == [[1], [2, 3, 4]]


# The step-following hold at 2.5 gaps up to 0.3 s, the defaults (half-integer: regular steps never
# tie with the hold); other values through the engine options are tested below.
STEP_HOLD = {"busy_hold_steps": 2.5, "busy_hold_max": 0.3}


def busy_service(clock, streams=32, hold=STEP_HOLD):
    """``streams`` open streamed requests with the busy hold (0.05 s scaled by open / 16: 0.1 s
    from 32 on; ``hold``: the step-following part), on a queue whose waits take no real time."""
    q = ScriptedQueue(clock)
    svc = make_service(clock, busy_stream_interval=0.05, q=q, **hold)
    rs = {f"r{i}": submit(svc, rid=f"r{i}", max_tokens=20) for i in range(streams)}
    step(svc)
    return svc, q, rs


def run_steps(svc, rs, tokens, every, last_final=False):
    """One engine step per token every ``every`` seconds, a delta for each request in each."""
    for i, t in enumerate(tokens):
        final = last_final and i == len(tokens) - 1
        for rid in rs:
            svc.loop.emit(rid, delta(rid, [t], finished=final, reason="length" if final else None))
        step(svc, every)


def test_busy_hold_gathers_three_steps_when_steps_are_as_slow_as_the_hold(clock):
    """At 32 streams the busy hold is 0.1 s; steps of 0.11 s would make every token its own
    response, so a choice's hold follows its own pace (busy_hold_steps = 2.5 gaps: 0.275 s):
    every response after the first token carries three steps' tokens, the stream's last tokens
    go with its final."""
    svc, q, rs = busy_service(clock)
    run_steps(svc, rs, range(1, 12), 0.11, last_final=True)
    for r in rs.values():
        assert r.ids() == [[1], [2, 3, 4], [5, 6, 7], [8, 9, 10], [11]] and r.finals == 1
    assert sum(len(r.sent) for r in rs.values()) == 32 * 5            # token by token: 32 * 11
    assert q.waits == [] and svc.responses._holding == {} and svc.responses._open == {}


def test_busy_step_hold_is_per_choice_and_waits_at_most_its_due_time(clock):
    svc, q, rs = busy_service(clock)
    run_steps(svc, {"r0": 0}, [1, 2], 0.11)           # r0 steps every 0.11 s: its token 2 is held
    run_steps(svc, {"r1": 0}, [1, 2], 0.001)          # r1 fast: 0.1 s hold, its token 2 held too
    assert rs["r0"].ids() == [[1]] and rs["r1"].ids() == [[1]]
    assert svc.responses.step(SWEEP)                  # the steps stall: r1's token is due first
    assert rs["r1"].ids() == [[1], [2]] and rs["r0"].ids() == [[1]]
    assert svc.responses.step(1.0)                    # then r0's, 2.5 * 0.11 s after it came
    assert rs["r0"].ids() == [[1], [2]]
    assert q.waits == [0.1, 0.173]                    # r1: 0.1 s after it came; r0: 0.275 s after


def test_busy_step_hold_leaves_fast_steps_and_few_streams_as_they_were(clock):
    svc, q, rs = busy_service(clock)
    run_steps(svc, rs, range(1, 10), 0.03)            # 2.5 gaps = 75 ms < the 0.1 s hold
    for r in rs.values():
        assert r.ids() == [[1], [2, 3, 4, 5], [6, 7, 8, 9]]
    svc2, _, rs2 = busy_service(clock, streams=15)    # below busy_streams: never held
    run_steps(svc2, rs2, range(1, 6), 0.12)
    for r in rs2.values():
        assert r.ids() == [[1], [2], [3], [4], [5]]


def test_busy_step_hold_is_capped(clock):
    """Steps of 0.25 s: the hold is busy_hold_max (0.3 s), not 2.5 gaps, so pairs; steps of
    0.35 s: longer than the cap, every token goes alone."""
    svc, q, rs = busy_service(clock)
    run_steps(svc, rs, range(1, 6), 0.25)
    assert svc.responses.hold_interval(0.25) == pytest.approx(0.3)
    for r in rs.values():
        assert r.ids() == [[1], [2, 3], [4, 5]]
    svc2, _, rs2 = busy_service(clock)
    run_steps(svc2, rs2, range(1, 6), 0.35)
    for r in rs2.values():
        assert r.ids() == [[1], [2], [3], [4], [5]]
    assert svc2.responses._holding == {}


def test_busy_hold_options_gather_five_steps_up_to_their_cap(clock):
    """busy_hold_steps 4.5, busy_hold_max 0.6 s: at 32 streams steps of 0.11 s go five to a
    response (4.5 gaps: 0.495 s), steps of 0.17 s four (the 0.6 s cap), steps slower than the cap
    one by one; the last tokens go with the final. The engine options' defaults are the thread's
    (STEP_HOLD, the tests above); test_serving_config checks that the options reach the thread."""
    from backend.config import ServingConfig
    from backend.serving.response_thread import BUSY_HOLD_MAX, BUSY_HOLD_STEPS
    args = ServingConfig()
    assert (args.busy_hold_steps, args.busy_hold_max) == (BUSY_HOLD_STEPS, BUSY_HOLD_MAX)
    assert STEP_HOLD == {"busy_hold_steps": BUSY_HOLD_STEPS, "busy_hold_max": BUSY_HOLD_MAX}
    five = {"busy_hold_steps": 4.5, "busy_hold_max": 0.6}
    svc, q, rs = busy_service(clock, hold=five)
    run_steps(svc, rs, range(1, 14), 0.11, last_final=True)
    for r in rs.values():
        assert r.ids() == [[1], [2, 3, 4, 5, 6], [7, 8, 9, 10, 11], [12, 13]] and r.finals == 1
    assert sum(len(r.sent) for r in rs.values()) == 32 * 4            # token by token: 32 * 13
    svc2, _, rs2 = busy_service(clock, hold=five)
    run_steps(svc2, rs2, range(1, 10), 0.17)
    for r in rs2.values():
        assert r.ids() == [[1], [2, 3, 4, 5], [6, 7, 8, 9]]
    svc3, _, rs3 = busy_service(clock, hold=five)
    run_steps(svc3, rs3, range(1, 4), 0.65)
    for r in rs3.values():
        assert r.ids() == [[1], [2], [3]]
