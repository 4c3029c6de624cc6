"""The response thread: everything a client of the engine model sees leaves from here.

    post(msg) ─► queue ─► step(): take the backlog ─► (linger) ─► coalesce ─► handle each message
                                                                    └─► latency events: one batch

It owns the table of open requests, so nothing else needs a lock on it, and it sends each
request's FINAL exactly once on every path: with the last choice's final delta (stop, length,
abort), with an error response (rejected, engine failure, deadline), as a bare FINAL after a
client cancel once the engine confirmed the abort, and at shutdown. After ``STOP`` the thread is
gone and ``post`` answers a late message itself, so a request submitted during shutdown still gets
its one FINAL.

Cancels and explicit aborts: ``cancel_watch.py``; how long tokens wait to be gathered: ``hold_policy.py``.

Text: with a ``detokenizer`` (backend/serving/postprocess.py ``Postprocessor``) the thread also
turns each delta into its text delta (and OpenAI-shaped logprobs) when the caller requested
``text_output``/``text_logprobs``, as the ``llm`` ensemble does: the ensemble then returns the
engine's responses directly, without a postprocessing model call per token. Only the outputs a
caller requested are built. A detokenization failure ends that request with an internal error.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

from backend.errors import EngineError, internal, unavailable
from backend.outputs import StepDelta
from backend.serving.errors import wire_kind
from backend.serving.cancel_watch import CANCEL_CHECK_INTERVAL, ENSEMBLE_CANCEL_CHECK, AbortTombstones, CancelWatch
from backend.serving.hold_policy import (BUSY_HOLD_MAX, BUSY_HOLD_STEPS, BUSY_STREAMS, DUE_SLACK, HoldPolicy, Pace,
                                         coalesce, merge_deltas)
from backend.serving.metrics import LatencyRecorder
from backend.serving.intake import (STOP, ControlAnswered, DeltaArrived, Held, Message, Opened,
                                      Rejected, RequestHandle)
from backend.serving.postprocess import engine_outputs, wants_text

log = logging.getLogger(__name__)

MAX_DRAIN = 4096                # messages taken per step (bounds one step's latency under a flood)


class ResponseThread:
    def __init__(self, loop: Any, tombstones: AbortTombstones, *, metrics: Any = None,
                 stream_interval: float = 0.0, busy_stream_interval: float = 0.0,
                 busy_hold_steps: float = BUSY_HOLD_STEPS, busy_hold_max: float = BUSY_HOLD_MAX,
                 busy_streams: int = BUSY_STREAMS, sweep_interval: float = 0.1,
                 cancel_check_interval: float = CANCEL_CHECK_INTERVAL,
                 ensemble_cancel_interval: float = ENSEMBLE_CANCEL_CHECK,
                 clock: Callable[[], float] = time.monotonic, q: queue.Queue | None = None,
                 detokenizer: Any = None) -> None:
        self.loop = loop
        self.detokenizer = detokenizer
        self.tombstones = tombstones
        self.metrics = metrics
        self.latency = LatencyRecorder(metrics)
        self.hold = HoldPolicy(stream_interval, busy_stream_interval, busy_hold_steps, busy_hold_max, busy_streams)
        self._holding: dict[RequestHandle, None] = {}   # requests with held deltas (ordered set)
        self.sweep_interval = sweep_interval
        self.cancels = CancelWatch(loop, metrics, on_cancel=self._drop_held, sweep_interval=sweep_interval,
                                   cancel_check_interval=cancel_check_interval,
                                   ensemble_cancel_interval=ensemble_cancel_interval)
        self._clock = clock
        self._q: queue.Queue = q if q is not None else queue.Queue()
        self._lock = threading.RLock()      # post() vs the switch to closed (re-entrant: inline answers)
        self._closed = False
        self._open: dict[RequestHandle, None] = {}      # an ordered set; response thread only
        self._next_sweep = clock() + sweep_interval
        self._thread = threading.Thread(target=self.run, name="llm-responses", daemon=True)

    # -- any thread ------------------------------------------------------------------------
    def start(self) -> None:
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
            self.cancels.sweep(self._open, now)
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
        """How long a choice's mid-stream tokens may wait now (hold_policy.HoldPolicy)."""
        return self.hold.interval(len(self._open), gap)

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
            self.cancels.opened(h)
        elif isinstance(msg, Rejected):
            self.latency.rejected(wire_kind(msg.error))
            self._finish(msg.handle, error=msg.error)
        elif isinstance(msg, ControlAnswered):
            self.cancels.answer_control(msg, self.tombstones, self.latency)
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
        if h.cancelled or self.cancels.seen(h, now):
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
            h.pace[index] = Pace(now)
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
            h.responder.send(engine_outputs(d, ttft=ttft, text=text, want=h.want), final=last)
        except Exception as exc:            # noqa: BLE001 - the stream is gone: stop generating
            log.debug("send for %s failed: %s", h.rid, exc)
            if last:
                self._done(h)
            else:
                self.cancels.cancel(h, now)
            return
        if last:
            self._done(h)
            if d.finish_reason in ("stop", "length"):
                self.latency.completed(h, now)

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
            h.responder.send(None, error=error, final=True)
        except Exception as exc:            # noqa: BLE001
            log.debug("final for %s not delivered: %s", h.rid, exc)
        self._done(h)

    def _done(self, h: RequestHandle) -> None:
        h.done = True
        self._drop_held(h)
        self._open.pop(h, None)
        self.tombstones.finished(h.rid)

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

    def _close_open(self) -> None:
        for h in list(self._open):
            self._finish(h, error=None if h.cancelled else unavailable("the server shut down"))
