"""The response thread: everything a client of the engine model sees leaves from here.

    post(msg) ─► queue ─► step(): take the backlog ─► (linger) ─► coalesce ─► handle each message
                                                                    └─► latency events: one batch

It owns the table of open requests, so nothing else needs a lock on it, and it sends each
request's FINAL exactly once on every path: with the last choice's final delta (stop, length,
abort), with an error response (rejected, engine failure, deadline), as a bare FINAL after a
client cancel once the engine confirmed the abort, and at shutdown. After ``STOP`` the thread is
gone and ``post`` answers a late message itself, so a request submitted during shutdown still gets
its one FINAL.

Cancellation costs an ``is_cancelled()`` IPC round trip, so it is checked per request on a time
basis: at most once per ``cancel_check_interval`` when the request sends (``ensemble_cancel_interval``
for a step of the ``llm`` ensemble, which Triton never tells about a cancel: its clients send an
explicit abort), and by the sweep (every ``sweep_interval``, or the request's own longer interval) when
it sends nothing. A cancel seen is aborted in the engine at once, so the
request's blocks are free before the engine's next step.

Senders: a ``send()`` is a blocking IPC round trip to tritonserver (~0.7 ms of wall time on the
disaggregated decode server, ~50 us of it CPU, the GIL released while it waits), so one thread
sending a step's responses one after another spreads them over most of the step. With ``senders``
> 0 (``TRITON_LLM_RESPONSE_SENDERS``, default ``SENDERS``) this thread builds each response and
queues it on the request's own sender thread (``llm-send-<i>``; a request keeps one sender for its
life, the least loaded when its first response goes out), which makes the IPC call: a request's
responses leave in order, its FINAL after its tokens, and several requests' sends overlap
(tritonserver handles each response message on its own pool thread). Bookkeeping stays here: a
request is done when its FINAL is queued; a failed send comes back as ``SendFailed`` and stops the
request as before. Before the thread is started (tests that drive ``step()``), after close, and
with ``senders=0`` every send is made inline, as before.

Text: with a ``detokenizer`` (backend/serving/postprocess.py ``Postprocessor``) the thread also
turns each delta into its text delta (and OpenAI-shaped logprobs) when the caller requested
``text_output``/``text_logprobs``, as the ``llm`` ensemble does: the ensemble then returns the
engine's responses directly, without a postprocessing model call per token. Only the outputs a
caller requested are built. A detokenization failure ends that request with an internal error.

Gathering: with a hold interval (``stream_interval``, or ``busy_stream_interval`` while at least
``busy_streams`` requests are open, scaled by how many are: ``hold_interval``) a choice's mid-stream
delta that comes less than the interval after the choice's last send is held and merged with the
next ones (``coalesce.merge_deltas``: the same tokens and text), so one response (one ``send`` IPC,
one ensemble hop, one gRPC message, one SSE chunk) carries several steps' tokens. Each choice has
its own clock, and a held token waits at most its choice's interval: the first delta that comes an
interval after the last send takes it along (sends stay on step boundaries), else the thread wakes
up at its deadline (the steps stalled). With an explicit ``stream_interval`` steps slower than the
interval are never held. The busy hold also follows the steps: it is at least ``busy_hold_steps``
times the choice's own recent gap between deltas (an average over its last few steps), up to
``busy_hold_max`` seconds (engine options; defaults BUSY_HOLD_STEPS 2.5, BUSY_HOLD_MAX 0.3 s), so
while many streams are open a response carries about three steps' tokens (two when the cap cuts in)
even when a step is as long as the hold or longer (a 32-stream step of a larger model on a small
CPU: ~0.07-0.15 s), and the responses per second stay a third of the steps' rate instead of one per
token; a token then waits at most about two steps more. Never held:
a choice's first token, finals (a held delta goes with them), errors (the held tokens go first), a
cancelled request's tokens (dropped, as before).
"""
from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from backend import protocol as P
from backend.errors import EngineError, internal, unavailable
from backend.outputs import StepDelta
from backend.serving.coalesce import coalesce, merge_deltas
from backend.serving.errors import wire_kind
from backend.serving.latency import ABORT_TO_FREE, LatencyRecorder
from backend.serving.messages import (STOP, ControlAnswered, DeltaArrived, Held, Message, Opened,
                                      Rejected, RequestHandle)
from backend.serving.responses import control_outputs, engine_outputs, wants_text
from backend.serving.tombstones import AbortTombstones
from backend.serving import ttft_trace

log = logging.getLogger(__name__)

MAX_DRAIN = 4096                # messages taken per step (bounds one step's latency under a flood)
CANCEL_CHECK_INTERVAL = 0.02    # s; at the 16-stream goal rate (~20 ms a token) about every other send
ENSEMBLE_CANCEL_CHECK = 1.0     # s; steps of the llm ensemble (Triton does not tell them about cancels)
BUSY_STREAMS = 16               # open requests from which busy_stream_interval gathers tokens
BUSY_SCALE_MAX = 2.0            # the busy hold grows with the open streams up to this factor
BUSY_HOLD_STEPS = 2.5           # the busy hold is at least this many of a choice's gaps between deltas
BUSY_HOLD_MAX = 0.3             # s; ... up to this: ~3 steps a response (2 at the cap), none over 0.3 s
GAP_WEIGHT = 0.3                # weight of the newest gap in a choice's average gap between deltas
DUE_SLACK = 0.001               # s; held deltas due this soon go with the ones due now (one wake-up)
SENDERS = 0                     # sender threads (0: this thread sends inline); TRITON_LLM_RESPONSE_SENDERS
SENDER_JOIN_S = 5.0             # s; at close, how long to wait for each sender to send what it has


def default_senders() -> int:
    try:
        return max(0, int(os.environ.get("TRITON_LLM_RESPONSE_SENDERS", SENDERS)))
    except ValueError:
        return SENDERS


class _Pace:
    """When a choice's last delta came and the average gap between its deltas (0: not known yet)."""
    __slots__ = ("last", "gap")

    def __init__(self, last: float) -> None:
        self.last = last
        self.gap = 0.0

    def arrived(self, now: float) -> float:
        """Note a delta that came ``now``; returns the average gap so far."""
        gap = now - self.last
        self.last = now
        self.gap = gap if self.gap == 0.0 else self.gap + GAP_WEIGHT * (gap - self.gap)
        return self.gap


@dataclass(slots=True)
class SendFailed:
    """A sender thread's send for ``handle`` raised (the stream is gone): stop the request."""
    handle: RequestHandle
    final: bool


# (start, wall seconds) of every send while a trace collects them (backend/disagg/trace.py sets a
# deque here and drains it); None: not timed
SEND_TIMES: "collections.deque | None" = None


def _send_one(h: RequestHandle, outputs: dict | None, error: EngineError | None, final: bool) -> None:
    if ttft_trace.ENABLED:
        ttft_trace.mark(h.rid, "rt.send0")
    times = SEND_TIMES
    t0 = time.monotonic() if times is not None else 0.0
    h.responder.send(outputs, error=error, final=final)
    if times is not None:
        times.append((t0, time.monotonic() - t0))
    if ttft_trace.ENABLED:
        ttft_trace.mark(h.rid, "rt.sent0")


class _Sender:
    """One sender thread: makes the queued sends of the requests assigned to it, in order."""

    def __init__(self, name: str, failed: Callable[[RequestHandle, bool], None]) -> None:
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.load = 0                       # open requests assigned (response thread only)
        self._failed = failed
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        _name_os_thread()
        while True:
            item = self.q.get()
            if item is None:
                return
            h, outputs, error, final = item
            try:
                _send_one(h, outputs, error, final)
            except Exception as exc:        # noqa: BLE001 - the stream is gone
                log.debug("send for %s failed: %s", h.rid, exc)
                self._failed(h, final)

    def close(self, timeout: float) -> None:
        self.q.put(None)
        self.thread.join(timeout)


def _name_os_thread() -> None:
    """The thread's name at the OS level too (top -H, bench_stack's per-thread CPU, layouts)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(threading.current_thread().name[:15])
    except OSError:
        pass


class ResponseThread:
    def __init__(self, loop: Any, tombstones: AbortTombstones, *, metrics: Any = None,
                 stream_interval: float = 0.0, busy_stream_interval: float = 0.0,
                 busy_hold_steps: float = BUSY_HOLD_STEPS, busy_hold_max: float = BUSY_HOLD_MAX,
                 busy_streams: int = BUSY_STREAMS, sweep_interval: float = 0.1,
                 cancel_check_interval: float = CANCEL_CHECK_INTERVAL,
                 ensemble_cancel_interval: float = ENSEMBLE_CANCEL_CHECK,
                 clock: Callable[[], float] = time.monotonic, q: queue.Queue | None = None,
                 detokenizer: Any = None, senders: int | None = None) -> None:
        self.loop = loop
        self.detokenizer = detokenizer
        self.tombstones = tombstones
        self.metrics = metrics
        self.latency = LatencyRecorder(metrics)
        self.stream_interval = stream_interval
        self.busy_stream_interval = busy_stream_interval
        self.busy_hold_steps, self.busy_hold_max = busy_hold_steps, busy_hold_max
        self.busy_streams = busy_streams
        self._holding: dict[RequestHandle, None] = {}   # requests with held deltas (ordered set)
        self.sweep_interval = sweep_interval
        self.cancel_check_interval = cancel_check_interval
        self.ensemble_cancel_interval = ensemble_cancel_interval
        self._clock = clock
        self._q: queue.Queue = q if q is not None else queue.Queue()
        self._lock = threading.RLock()      # post() vs the switch to closed (re-entrant: inline answers)
        self._closed = False
        self._open: dict[RequestHandle, None] = {}      # an ordered set; response thread only
        self._next_sweep = clock() + sweep_interval
        # sender threads: how many new requests are spread over (may change while serving: a
        # request keeps the sender it got), the threads, and each open request's sender
        self.senders = default_senders() if senders is None else max(0, senders)
        self._senders: list[_Sender] = []
        self._sender_of: dict[RequestHandle, _Sender] = {}
        self._use_senders = False           # started and not closed: sends go to the senders
        self._thread = threading.Thread(target=self.run, name="llm-responses", daemon=True)

    # -- any thread ------------------------------------------------------------------------
    def start(self) -> None:
        self._use_senders = True
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def post(self, msg: Message) -> None:
        """Queue a message; once closed, answer it here (under the lock, one caller at a time)."""
        with self._lock:
            if not self._closed:
                self._q.put(msg)
                return
            if msg is not STOP:
                self._handle(msg)
                self._close_open()
                self.latency.flush()

    def stop(self, timeout: float = 10.0) -> None:
        """Answer what is queued and close; runs the steps here if the thread is not running.
        A second call (the drain closed it, then finalize) does nothing."""
        with self._lock:
            if self._closed:
                return
        self.post(STOP)
        if self._thread.is_alive():
            self._thread.join(timeout)
        else:
            while self.step(0):
                pass

    # -- response thread -------------------------------------------------------------------
    def run(self) -> None:
        while self.step(self.sweep_interval):
            pass

    def step(self, timeout: float | None) -> bool:
        """Handle what is queued (waiting up to ``timeout`` for the first message, less if a held
        delta falls due sooner); False after STOP."""
        if self._holding and timeout is not None:
            timeout = max(0.0, min(timeout, self._next_due() - self._clock()))
        try:
            batch = [self._q.get(timeout=timeout)]
        except queue.Empty:
            batch = []
        self._drain(batch)
        stop = bool(batch) and batch[-1] is STOP
        for msg in coalesce(batch[:-1] if stop else batch):
            try:
                self._handle(msg)
            except Exception:               # noqa: BLE001 - the thread must survive a bad message
                log.exception("response thread failed on %s", type(msg).__name__)
        if stop:
            self._close()
            return False
        now = self._clock()
        if self._holding:
            self._send_due(now)
        if now >= self._next_sweep:
            self._sweep(now)
            self._next_sweep = now + self.sweep_interval
        self.latency.flush()
        return True

    def _drain(self, batch: list[Message]) -> None:
        """Append the queued backlog (coalesce merges it into fewer sends)."""
        while batch and batch[-1] is not STOP and len(batch) < MAX_DRAIN:
            try:
                batch.append(self._q.get_nowait())
            except queue.Empty:
                return

    def hold_interval(self, gap: float = 0.0) -> float:
        """How long a choice's mid-stream tokens may wait to be gathered: ``stream_interval`` if
        set, else, while at least ``busy_streams`` requests are open (many streams: each
        response's IPC and downstream work is worth sharing between steps), the larger of
        ``busy_stream_interval`` times (open requests / ``busy_streams``, at most BUSY_SCALE_MAX)
        and ``busy_hold_steps`` times ``gap``, the choice's average gap between deltas (up to
        ``busy_hold_max``), else 0."""
        if self.stream_interval > 0:
            return self.stream_interval
        n = len(self._open)
        if self.busy_stream_interval > 0 and n >= self.busy_streams:
            # Grows with the open streams (up to BUSY_SCALE_MAX times): the responses per second
            # stay about busy_streams / busy_stream_interval however many streams are open, so
            # the stack's CPU per response (send IPC, ensemble hop, gRPC, shim) stops growing
            # with the load; with the defaults 0.05 s at 16 streams, 0.1 s from 32.
            hold = self.busy_stream_interval * min(n / self.busy_streams, BUSY_SCALE_MAX)
            # Steps nearly as long as that or longer (bench-110m / SmolLM2 at 32 streams on 2
            # cores: ~0.07-0.15 s) would make (nearly) every token its own response: hold across
            # the next two steps, so a response carries three steps' tokens (a third of the
            # responses: each costs ~1-2 ms of CPU across the stub, tritonserver, shim, client).
            return max(hold, min(self.busy_hold_steps * gap, self.busy_hold_max))
        return 0.0

    def _next_due(self) -> float:
        return min(held.due for h in self._holding for held in h.held.values())

    def _send_due(self, now: float) -> None:
        """Send the held deltas whose deadline passed (no later step came to carry them)."""
        for h in list(self._holding):
            for index, held in list(h.held.items()):
                if held.due <= now + DUE_SLACK:
                    del h.held[index]
                    self._send(h, held.delta, now, last=False)
            if not h.held:
                self._holding.pop(h, None)

    def _take_held(self, h: RequestHandle, index: int) -> Held | None:
        held = h.held.pop(index, None)
        if held is not None and not h.held:
            self._holding.pop(h, None)
        return held

    def _send_held(self, h: RequestHandle, now: float) -> None:
        """Send every held delta of ``h`` now (before its error or shutdown final)."""
        for index in list(h.held):
            self._send(h, self._take_held(h, index).delta, now, last=False)
            if h.done or h.cancelled:
                return

    def _drop_held(self, h: RequestHandle) -> None:
        if h.held:
            h.held.clear()
            self._holding.pop(h, None)

    def _handle(self, msg: Message) -> None:
        if isinstance(msg, DeltaArrived):
            self._on_delta(msg.handle, msg.delta)
        elif isinstance(msg, Opened):
            h = msg.handle
            self._open[h] = None
            # A step of the llm ensemble (it asks for the text outputs, never the token window) is
            # not told about client cancels (Triton does not forward them into ensemble steps; the
            # clients send an explicit abort): ask for it only once a second (at 32 streams, every
            # 100 ms was as many IPC round trips as the gathered sends themselves).
            ensemble_step = h.want is not None and P.TEXT_LOGPROBS in h.want and P.WINDOW_IDS not in h.want
            h.cancel_every = self.ensemble_cancel_interval if ensemble_step else self.cancel_check_interval
        elif isinstance(msg, Rejected):
            self.latency.rejected(wire_kind(msg.error))
            self._finish(msg.handle, error=msg.error)
        elif isinstance(msg, ControlAnswered):
            self._on_control(msg)
        elif isinstance(msg, SendFailed):
            h = msg.handle
            if not h.done and not h.cancelled:
                self._cancel(h, self._clock())
        else:
            raise TypeError(f"not a response-queue message: {msg!r}")

    def _on_delta(self, h: RequestHandle, d: StepDelta) -> None:
        if h.done:
            return
        now = self._clock()
        if d.finished:
            h.remaining -= 1
            self.latency.finished(d.finish_reason or "abort")
        last = h.remaining <= 0
        error = d.error
        if error is None and d.finish_reason == "error":
            error = internal("the engine failed this request")
        if error is not None:
            self._finish(h, error=error, abort_rest=not last)
            return
        if h.cancelled or self._cancel_seen(h, now):
            if last:
                self._finish(h)
            return
        due = None
        if h.held:
            held = self._take_held(h, d.index)
            if held is not None:
                # an abort final goes alone (clients stop reading at it); a stop-string cut is
                # never merged: in both cases the held tokens go first
                merged = None if d.finish_reason == "abort" else merge_deltas(held.delta, d)
                if merged is None:
                    self._send(h, held.delta, now, last=False)
                    if h.done or h.cancelled:
                        return
                else:
                    d, due = merged, held.due
        if not d.finished and h.stream:
            interval = self.hold_interval(self._arrived(h, d.index, now))
            if interval > 0:
                sent = h.last_token.get(d.index)
                if sent is not None and now - sent < interval:      # not a first token: hold it
                    h.held[d.index] = Held(d, due=now + interval if due is None else due)
                    self._holding[h] = None
                    return
        self._send(h, d, now, last)

    def _arrived(self, h: RequestHandle, index: int, now: float) -> float:
        """Note a streamed choice's mid-stream delta; returns its average gap between deltas (0: first)."""
        pace = h.pace.get(index)
        if pace is None:
            h.pace[index] = _Pace(now)
            return 0.0
        return pace.arrived(now)

    def _send(self, h: RequestHandle, d: StepDelta, now: float, last: bool) -> None:
        """Detokenize, build and send one delta's response (FINAL with the last choice's final)."""
        text = None
        if self.detokenizer is not None and wants_text(h.want):
            try:
                text = self.detokenizer.delta_text(d, h.skip_special_tokens)
            except Exception:               # noqa: BLE001 - this request fails, the thread goes on
                log.exception("detokenizing a response of %s failed", h.rid)
                self._finish(h, error=internal("detokenizing the response failed"), abort_rest=not last)
                return
        ttft = self.latency.delta(h, d, now)
        try:
            self._deliver(h, engine_outputs(d, ttft=ttft, text=text, want=h.want), None, last)
        except Exception as exc:            # noqa: BLE001 - the stream is gone: stop generating
            log.debug("send for %s failed: %s", h.rid, exc)
            if last:
                self._done(h)
            else:
                self._cancel(h, now)
            return
        if last:
            self._done(h)
            if d.finish_reason in ("stop", "length"):
                self.latency.completed(h, now)

    def _on_control(self, msg: ControlAnswered) -> None:
        try:
            freed = msg.freed.result()
        except Exception:                   # noqa: BLE001 - the engine is gone: nothing was freed
            freed = None
        if freed is not None or self.tombstones.has_finished(msg.target):
            self.tombstones.clear(msg.target)   # it was running (or already done): no tombstone
        if freed is not None:
            self.latency.abort_freed(freed - msg.seen)
        try:
            msg.responder.send(control_outputs(freed is not None), final=True)
        except Exception:                   # noqa: BLE001 - the control client went away
            log.debug("abort control answer for %s not delivered", msg.target)

    def _cancel_seen(self, h: RequestHandle, now: float) -> bool:
        """Ask Triton at most once per ``cancel_check_interval`` whether the client went away."""
        return now - h.last_check >= h.cancel_every and self._check(h, now)

    def _check(self, h: RequestHandle, now: float) -> bool:
        h.last_check = now
        try:
            gone = h.responder.is_cancelled()
        except Exception:                   # noqa: BLE001
            gone = True
        if gone:
            self._cancel(h, now)
        return gone

    def _cancel(self, h: RequestHandle, now: float) -> None:
        """Stop generating; the request's FINAL goes out bare when the engine's abort delta comes."""
        h.cancelled = True
        self._drop_held(h)
        fut = self.loop.abort(h.rid)
        m = self.metrics
        if m is not None:
            def freed(f) -> None:           # runs on the engine thread: only a queue put
                if not f.cancelled() and f.exception() is None and f.result() is not None:
                    m.observe(ABORT_TO_FREE, f.result() - now)
            fut.add_done_callback(freed)

    def _sweep(self, now: float) -> None:
        """Requests that send nothing for a while (queued, non-streaming) are checked here."""
        for h in list(self._open):
            if not h.done and not h.cancelled and now - h.last_check >= max(self.sweep_interval, h.cancel_every):
                self._check(h, now)

    def _finish(self, h: RequestHandle, *, error: EngineError | None = None, abort_rest: bool = False) -> None:
        """Send the request's one FINAL (with an error response if given)."""
        if h.done:
            return
        if h.held and not h.cancelled:      # tokens generated before the error still go out
            self._send_held(h, self._clock())
            if h.done:
                return
        if abort_rest and getattr(self.loop, "healthy", True):
            self.loop.abort(h.rid)          # its other choices must stop too
        try:
            self._deliver(h, None, error, True)
        except Exception as exc:            # noqa: BLE001
            log.debug("final for %s not delivered: %s", h.rid, exc)
        self._done(h)

    def _done(self, h: RequestHandle) -> None:
        h.done = True
        self._drop_held(h)
        self._open.pop(h, None)
        s = self._sender_of.pop(h, None)
        if s is not None:
            s.load -= 1
        self.tombstones.finished(h.rid)

    # -- sends -----------------------------------------------------------------------------
    def _deliver(self, h: RequestHandle, outputs: dict | None, error: EngineError | None, final: bool) -> None:
        """Send one response of ``h``: queued on its sender thread, or inline (raises if that fails)."""
        s = self._sender_of.get(h)
        if s is None and self._use_senders and self.senders > 0:
            while len(self._senders) < self.senders:
                self._senders.append(_Sender(f"llm-send-{len(self._senders)}", self._send_failed))
            s = min(self._senders[:self.senders], key=lambda x: x.load)
            s.load += 1
            self._sender_of[h] = s
        if s is None:
            _send_one(h, outputs, error, final)
        else:
            s.q.put((h, outputs, error, final))

    def _send_failed(self, h: RequestHandle, final: bool) -> None:
        """Sender thread: hand the failure to this thread (the queue directly: never the lock,
        which ``_close`` holds while it waits for the senders)."""
        self._q.put(SendFailed(h, final))

    def _close_senders(self) -> None:
        """Let every sender send what it has, then send inline from now on."""
        self._use_senders = False
        for s in self._senders:
            s.close(SENDER_JOIN_S)
        self._senders.clear()
        self._sender_of.clear()

    def _close(self) -> None:
        """STOP: apply what is still queued, end every open request, answer later posts inline."""
        with self._lock:
            self._closed = True
            while True:
                try:
                    msg = self._q.get_nowait()
                except queue.Empty:
                    break
                if msg is not STOP:
                    try:
                        self._handle(msg)
                    except Exception:       # noqa: BLE001
                        log.exception("response thread failed while closing")
            self._close_open()
            self.latency.flush()
            self._close_senders()

    def _close_open(self) -> None:
        for h in list(self._open):
            self._finish(h, error=None if h.cancelled else unavailable("the server shut down"))
