"""The response thread's sender threads (backend/serving/response_thread.py ``senders``): sends of
several requests overlap, each request's responses still leave in order with its FINAL last and
exactly once, a failed send stops its request, and close sends everything queued first.

The response thread runs for real (started); its responders are the pb_utils boundary, faked here
as recorders whose ``send`` can be made to block until the test releases it (a slow IPC round
trip). Every wait is on a condition (an event set by a responder), never on elapsed time.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from backend.outputs import StepDelta
from backend.serving.messages import DeltaArrived, Opened, RequestHandle
from backend.serving.response_thread import ResponseThread
from backend.serving.tombstones import AbortTombstones

WAIT = 30.0                                 # generous bound on condition waits (fails, never sleeps)


class Responder:
    """Records (thread name, output ids, error, final); optionally blocks in send until released."""

    def __init__(self, fail: bool = False):
        self.sent: list[tuple[str, list[int] | None, object, bool]] = []
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Event()     # a send started (and may be blocked)
        self.final = threading.Event()
        self.fail = fail
        self.lock = threading.Lock()

    def send(self, outputs=None, *, error=None, final=False):
        self.entered.set()
        assert self.release.wait(WAIT), "the test never released this send"
        with self.lock:
            assert not any(f for *_, f in self.sent), "nothing may follow FINAL"
            ids = None if outputs is None else [int(t) for t in outputs["output_ids"]]
            self.sent.append((threading.current_thread().name, ids, error, final))
        if final:
            self.final.set()
        if self.fail:
            raise RuntimeError("stream closed")

    def is_cancelled(self):
        return False

    def ids(self):
        return [t for _, ids, _, _ in self.sent if ids for t in ids]

    def threads(self):
        return {name for name, *_ in self.sent}


class Loop:
    """The EngineLoop surface the response thread uses: abort futures."""

    def __init__(self):
        self.healthy = True
        self.aborted: list[str] = []
        self.abort_seen = threading.Event()

    def abort(self, rid, tenant=None):
        self.aborted.append(rid)
        self.abort_seen.set()
        fut = Future()
        fut.set_result(None)
        return fut


def delta(rid, tokens, finished=False, reason=None):
    return StepDelta(rid, 0, list(tokens), list(tokens), 0, finished=finished, finish_reason=reason,
                     prompt_tokens=3, completion_tokens=len(tokens))


def open_request(rt, rid, responder=None):
    h = RequestHandle(rid, responder or Responder(), arrival=0.0)
    rt.post(Opened(h))
    return h


@pytest.fixture
def rt():
    thread = ResponseThread(Loop(), AbortTombstones(), senders=3, cancel_check_interval=1e9)
    thread.start()
    yield thread
    thread.stop()


def stream(rt, h, n, first=0):
    for i in range(first, first + n):
        rt.post(DeltaArrived(h, delta(h.rid, [i])))


def test_a_slow_send_does_not_hold_back_other_requests(rt):
    slow = open_request(rt, "slow")
    slow.responder.release.clear()           # its first send blocks (a slow IPC round trip)
    fast = open_request(rt, "fast")
    rt.post(DeltaArrived(slow, delta("slow", [1])))
    assert slow.responder.entered.wait(WAIT)
    stream(rt, fast, 5)
    rt.post(DeltaArrived(fast, delta("fast", [5], finished=True, reason="length")))
    # the fast request's whole stream goes out while the slow one's first send is still blocked
    assert fast.responder.final.wait(WAIT)
    assert fast.responder.ids() == [0, 1, 2, 3, 4, 5]
    assert slow.responder.sent == []
    rt.post(DeltaArrived(slow, delta("slow", [2], finished=True, reason="length")))
    slow.responder.release.set()
    assert slow.responder.final.wait(WAIT)
    assert slow.responder.ids() == [1, 2]
    assert [f for *_, f in slow.responder.sent] == [False, True]


def test_every_request_keeps_its_order_and_one_sender_and_finals_once(rt):
    hs = [open_request(rt, f"r{k}") for k in range(9)]
    for h in hs:                             # all open at once: each gets the least loaded sender
        rt.post(DeltaArrived(h, delta(h.rid, [-1])))
    for h in hs:
        assert h.responder.entered.wait(WAIT)
    for step in range(40):                   # interleaved, as steps produce them
        for h in hs:
            rt.post(DeltaArrived(h, delta(h.rid, [step])))
    for h in hs:
        rt.post(DeltaArrived(h, delta(h.rid, [40], finished=True, reason="length")))
    for h in hs:
        assert h.responder.final.wait(WAIT)
        assert h.responder.ids() == list(range(-1, 41))  # coalesced or not: every token, in order
        assert sum(f for *_, f in h.responder.sent) == 1 and h.responder.sent[-1][3]
        assert len(h.responder.threads()) == 1           # one sender for its whole life
    used = set().union(*(h.responder.threads() for h in hs))
    assert used == {"llm-send-0", "llm-send-1", "llm-send-2"}   # spread over all three (least loaded)


def test_a_request_keeps_its_sender_when_the_count_changes(rt):
    a = open_request(rt, "a")
    stream(rt, a, 3)
    b = open_request(rt, "b")
    stream(rt, b, 1)
    rt.senders = 0                           # new requests from now on: sent inline
    c = open_request(rt, "c")
    for h, n in ((a, 3), (b, 1), (c, 0)):
        stream(rt, h, 2, first=n)
        rt.post(DeltaArrived(h, delta(h.rid, [n + 2], finished=True, reason="stop")))
    for h in (a, b, c):
        assert h.responder.final.wait(WAIT)
    assert a.responder.ids() == [0, 1, 2, 3, 4, 5] and len(a.responder.threads()) == 1
    assert b.responder.ids() == [0, 1, 2, 3] and len(b.responder.threads()) == 1
    assert c.responder.threads() == {"llm-responses"}


def test_a_failed_send_on_a_sender_stops_the_request():
    loop = Loop()
    rt = ResponseThread(loop, AbortTombstones(), senders=2, cancel_check_interval=1e9)
    rt.start()
    try:
        h = open_request(rt, "gone", Responder(fail=True))
        rt.post(DeltaArrived(h, delta("gone", [7])))
        assert loop.abort_seen.wait(WAIT)    # the failure came back: the engine is told to stop
        assert loop.aborted == ["gone"]
        # the engine's abort delta then ends it with one bare FINAL
        rt.post(DeltaArrived(h, delta("gone", [], finished=True, reason="abort")))
        assert h.responder.final.wait(WAIT)
        assert [(ids, f) for _, ids, _, f in h.responder.sent] == [([7], False), (None, True)]
    finally:
        rt.stop()


def test_stop_sends_what_the_senders_hold_then_answers_inline():
    rt = ResponseThread(Loop(), AbortTombstones(), senders=2, cancel_check_interval=1e9)
    rt.start()
    h = open_request(rt, "open")
    h.responder.release.clear()
    stream(rt, h, 3)
    assert h.responder.entered.wait(WAIT)
    stopper = threading.Thread(target=rt.stop)
    stopper.start()
    h.responder.release.set()                # the blocked send completes; stop waits for the rest
    stopper.join(WAIT)
    assert not stopper.is_alive()
    # every queued token, then the shutdown's error FINAL, all before stop() returned
    assert h.responder.ids() == [0, 1, 2]
    assert [f for *_, f in h.responder.sent] == [False] * (len(h.responder.sent) - 1) + [True]
    assert h.responder.sent[-1][2] is not None
    late = open_request(rt, "late")         # after close: answered inline, on this thread
    assert late.responder.final.is_set()
    assert late.responder.threads() == {threading.current_thread().name}


def test_without_senders_the_response_thread_sends_inline():
    rt = ResponseThread(Loop(), AbortTombstones(), senders=0, cancel_check_interval=1e9)
    rt.start()
    try:
        h = open_request(rt, "r")
        stream(rt, h, 2)
        rt.post(DeltaArrived(h, delta("r", [2], finished=True, reason="length")))
        assert h.responder.final.wait(WAIT)
        assert h.responder.ids() == [0, 1, 2] and h.responder.threads() == {"llm-responses"}
    finally:
        rt.stop()
