"""Noticing that a client went away, and stopping its request; explicit aborts.

Cancellation costs an ``is_cancelled()`` IPC round trip, so it is checked per request on a time
basis: at most once per ``cancel_check_interval`` when the request sends (``ensemble_cancel_interval``
for a step of the ``llm`` ensemble, which Triton never tells about a cancel: its clients send an
explicit abort), and by the sweep (every ``sweep_interval``, or the request's own longer interval)
when it sends nothing. A cancel seen is aborted in the engine at once, so the request's blocks are
free before the engine's next step. An explicit abort (a control request) is answered here too.
Runs on the response thread only, except the tombstones' ``leave`` / ``take`` (execute thread).

Tombstones: inside the ``llm`` ensemble a client's abort goes straight to the engine model while
its request may still be in preprocessing. Such an abort leaves a tombstone for ``ttl`` seconds;
the request, when it arrives, is answered with ``finish_reason="abort"`` without running. An abort
whose target is running (the engine freed it) or already finished leaves none, so a later request
that reuses the id runs normally.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Iterable

from backend import protocol as P
from backend.serving.metrics import ABORT_TO_FREE, LatencyRecorder
from backend.serving.intake import ControlAnswered, RequestHandle
from backend.serving.postprocess import control_outputs

log = logging.getLogger(__name__)

CANCEL_CHECK_INTERVAL = 0.02    # s; at the 16-stream goal rate (~20 ms a token) about every other send
ENSEMBLE_CANCEL_CHECK = 1.0     # s; steps of the llm ensemble (Triton does not tell them about cancels)
RECENT = 4096                   # finished ids remembered (an abort after finish is a no-op)


class CancelWatch:
    def __init__(self, loop: Any, metrics: Any, *, on_cancel: Callable[[RequestHandle], None],
                 sweep_interval: float = 0.1, cancel_check_interval: float = CANCEL_CHECK_INTERVAL,
                 ensemble_cancel_interval: float = ENSEMBLE_CANCEL_CHECK) -> None:
        self.loop, self.metrics = loop, metrics
        self._on_cancel = on_cancel                 # the response thread drops the held tokens
        self.sweep_interval = sweep_interval
        self.cancel_check_interval = cancel_check_interval
        self.ensemble_cancel_interval = ensemble_cancel_interval

    def opened(self, h: RequestHandle) -> None:
        # A step of the llm ensemble (it asks for the text outputs, never the token window) is not
        # told about client cancels: ask for it only once a second (at 32 streams, every 100 ms
        # was as many IPC round trips as the gathered sends themselves).
        ensemble_step = h.want is not None and P.TEXT_LOGPROBS in h.want and P.WINDOW_IDS not in h.want
        h.cancel_every = self.ensemble_cancel_interval if ensemble_step else self.cancel_check_interval

    def seen(self, h: RequestHandle, now: float) -> bool:
        """Ask Triton at most once per the request's interval whether the client went away."""
        return now - h.last_check >= h.cancel_every and self.check(h, now)

    def check(self, h: RequestHandle, now: float) -> bool:
        h.last_check = now
        try:
            gone = h.responder.is_cancelled()
        except Exception:                   # noqa: BLE001
            gone = True
        if gone:
            self.cancel(h, now)
        return gone

    def cancel(self, h: RequestHandle, now: float) -> None:
        """Stop generating; the request's FINAL goes out bare when the engine's abort delta comes."""
        h.cancelled = True
        self._on_cancel(h)
        fut = self.loop.abort(h.rid)
        m = self.metrics
        if m is not None:
            def freed(f) -> None:           # runs on the engine thread: only a queue put
                if not f.cancelled() and f.exception() is None and f.result() is not None:
                    m.observe(ABORT_TO_FREE, f.result() - now)
            fut.add_done_callback(freed)

    def sweep(self, open_requests: Iterable[RequestHandle], now: float) -> None:
        """Requests that send nothing for a while (queued, non-streaming) are checked here."""
        for h in list(open_requests):
            if not h.done and not h.cancelled and now - h.last_check >= max(self.sweep_interval, h.cancel_every):
                self.check(h, now)

    @staticmethod
    def answer_control(msg: ControlAnswered, tombstones: AbortTombstones, latency: LatencyRecorder) -> None:
        """The engine answered an explicit abort (a control request): tell its sender whether the
        request was running, and drop the tombstone of one that was (or had finished)."""
        try:
            freed = msg.freed.result()
        except Exception:                   # noqa: BLE001 - the engine is gone: nothing was freed
            freed = None
        if freed is not None or tombstones.has_finished(msg.target):
            tombstones.clear(msg.target)    # it was running (or already done): no tombstone
        if freed is not None:
            latency.abort_freed(freed - msg.seen)
        try:
            msg.responder.send(control_outputs(freed is not None), final=True)
        except Exception:                   # noqa: BLE001 - the control client went away
            log.debug("abort control answer for %s not delivered", msg.target)


class AbortTombstones:
    """Explicit aborts that arrived before their request, and the ids of finished requests."""

    def __init__(self, ttl: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()       # execute thread (leave, take) vs response thread (clear)
        self._expiry: dict[str, float] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()   # response thread only

    def leave(self, target: str) -> None:
        """An abort for ``target`` arrived (execute thread)."""
        with self._lock:
            self._expiry[target] = self._clock() + self.ttl

    def take(self, rid: str) -> bool:
        """True if an unexpired abort for ``rid`` came first (the request must not run)."""
        now = self._clock()
        with self._lock:
            expiry = self._expiry.pop(rid, None)
            for k in [k for k, e in self._expiry.items() if e < now]:
                del self._expiry[k]
        return expiry is not None and expiry >= now

    def clear(self, target: str) -> None:
        """The abort found its target (running, or finished before): no tombstone."""
        with self._lock:
            self._expiry.pop(target, None)

    def finished(self, rid: str) -> None:
        """``rid`` got its FINAL (response thread)."""
        self._finished[rid] = None
        self._finished.move_to_end(rid)
        while len(self._finished) > RECENT:
            self._finished.popitem(last=False)

    def has_finished(self, rid: str) -> bool:
        return rid in self._finished
