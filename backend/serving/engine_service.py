"""The plain-Python half of the decoupled ``engine`` model: intake, response thread, aborts, health.

    execute() ─► EngineService.submit ─► EngineLoop.submit ─► [engine thread] ─► sink
                        │ ("open" / "reject" / "control")                     │ StepDelta
                        ▼                                                      ▼
                 response queue ─────────────────────────────────► response thread:
                                                                   is_cancelled() once per send,
                                                                   send(), FINAL exactly once,
                                                                   metric events ─► metrics thread

``execute()`` never blocks on the engine or on a send: it only enqueues. Everything a client sees
leaves through the response thread, which owns the open-request table, so ordering is FIFO per
request: the "open" marker is queued before the engine can produce the request's first delta.

FINAL is sent exactly once per request on every path: after the last choice's final delta (done,
stop, length), with an error response (bad request, engine failure, deadline), after a client
cancel (a bare FINAL once the engine confirmed the abort), and at shutdown.

Explicit abort: a request with parameter ``abort_request_id`` and no ``input_ids`` stops that
request (``finish_reason="abort"``) and is answered with one FINAL response. An abort that arrives
before its target (the target is still in preprocessing) is remembered for ``tombstone_ttl``
seconds, and the target is then answered with ``abort`` without running.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from backend.outputs import StepDelta
from backend.serving.errors import RequestError, invalid_request, tagged, unavailable
from backend.serving.request_params import fit_context, parse_parameters, request_settings
from backend.serving.responses import control_outputs, engine_outputs

log = logging.getLogger(__name__)
_STOP = ("stop",)


class Responder(Protocol):
    """One request's response sender (model.py wraps pb_utils' ResponseSender)."""

    def send(self, outputs: dict | None = None, *, error: RequestError | None = None,
             final: bool = False) -> None: ...

    def is_cancelled(self) -> bool: ...


@dataclass
class Incoming:
    """A request as execute() copied it out of pb_utils."""
    request_id: str
    input_ids: list[int] | None
    parameters: str | dict | None
    responder: Responder
    timeout_s: float | None = None          # Triton's own request timeout, if the client set one


@dataclass
class _Open:
    rid: str
    responder: Responder
    remaining: int                          # choices whose final delta has not arrived
    stream: bool
    arrival: float
    cancelled: bool = False                 # the client went away: no more data, bare FINAL
    done: bool = False                      # FINAL sent
    first_token: float | None = None
    last_token: dict[int, float] = field(default_factory=dict)
    queue_time_seen: bool = False
    last_check: float = 0.0                 # last is_cancelled() call


MAX_DRAIN = 4096


def merge_deltas(a: StepDelta, b: StepDelta) -> StepDelta | None:
    """One delta equivalent to sending ``a`` then ``b`` (same choice), or None if they must stay apart.

    b's window starts at most CONTEXT_TOKENS before the end of a's, and its first ``num_sent`` ids
    are already-sent context, so a's window followed by b's new ids is one window with a's
    ``num_sent``. A stop-string cut (``max_chars``) is relative to its own window: never merged.
    """
    if a.finished or a.max_chars >= 0 or b.max_chars >= 0 or a.error or b.error:
        return None
    return replace(b, new_token_ids=a.new_token_ids + b.new_token_ids,
                   window_ids=a.window_ids + b.window_ids[b.num_sent:], num_sent=a.num_sent,
                   logprobs=a.logprobs + b.logprobs)


def coalesce(items: list) -> list:
    """Merge the queued deltas of each choice when the response thread fell behind.

    Under load the engine produces deltas faster than one IPC send each can carry them; merging
    a choice's backlog keeps every token and its order while sending (and postprocessing) once.
    Items other than deltas keep their place.
    """
    if len(items) < 2:
        return items
    out: list = []
    last: dict[tuple[int, int], int] = {}       # (request handle, choice) -> position in out
    for item in items:
        if isinstance(item[0], str):
            out.append(item)
            continue
        h, d = item
        key = (id(h), d.index)
        at = last.get(key)
        merged = None if at is None else merge_deltas(out[at][1], d)
        if merged is None:
            last[key] = len(out)
            out.append(item)
        else:
            out[at] = (h, merged)
    return out


class EngineService:
    def __init__(self, loop: Any, *, max_model_len: int, metrics: Any = None,
                 sweep_interval: float = 0.1, tombstone_ttl: float = 30.0,
                 stream_interval: float = 0.0) -> None:
        self.loop = loop
        self.stream_interval = stream_interval
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.sweep_interval = sweep_interval
        self.tombstone_ttl = tombstone_ttl
        self._q: queue.Queue = queue.Queue()
        self._open: dict[str, _Open] = {}                       # response thread only
        self._recent: OrderedDict[str, float] = OrderedDict()   # finished ids (response thread)
        self._abort_lock = threading.Lock()
        self._aborted_early: dict[str, float] = {}              # abort seen before its target
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="llm-responses", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return bool(getattr(self.loop, "healthy", True)) and self._thread.is_alive()

    # -- execute() thread ------------------------------------------------------------------
    def submit(self, inc: Incoming) -> None:
        now = time.monotonic()
        rid = inc.request_id or uuid.uuid4().hex
        h = _Open(rid, inc.responder, remaining=1, stream=True, arrival=now, last_check=now)
        try:
            params = parse_parameters(inc.parameters)
            target = params.get("abort_request_id")
            if target not in (None, ""):
                self._control(str(target), inc.responder)
                return
            if inc.input_ids is None:
                raise invalid_request("input_ids", "input_ids is required (or the abort_request_id parameter)")
            if not self._accepting:
                raise unavailable("the server is shutting down")
            settings = request_settings(params)
            fit_context(settings, len(inc.input_ids), self.max_model_len, "input_ids")
            h.remaining, h.stream = settings.sampling.n, settings.stream
            if self._take_early_abort(rid):
                self._q.put(("open", h))
                for i in range(h.remaining):
                    self._q.put((h, StepDelta(rid, i, [], [], 0, finished=True, finish_reason="abort",
                                              prompt_tokens=len(inc.input_ids))))
                return
            deadline = None
            timeouts = [t for t in (settings.timeout, inc.timeout_s) if t]
            if timeouts:
                deadline = now + min(timeouts)
            self._q.put(("open", h))          # before the engine can produce a delta for it
            try:
                self.loop.submit(rid, inc.input_ids, settings.sampling, sink=lambda d, h=h: self._q.put((h, d)),
                                 stream=settings.stream, salt=settings.tenant, priority=settings.priority,
                                 deadline=deadline)
            except ValueError as exc:        # the engine's own checks (token ids in vocabulary, ...)
                text = str(exc)
                if text.startswith("prompt"):
                    raise invalid_request("input_ids", text) from None
                if text.startswith("request_id"):
                    raise invalid_request("request_id", text) from None
                raise
        except Exception as exc:             # noqa: BLE001 - every failure becomes a tagged answer
            self._q.put(("reject", h, tagged(exc)))

    def _control(self, target: str, responder: Responder) -> None:
        with self._abort_lock:
            self._aborted_early[target] = time.monotonic() + self.tombstone_ttl
        t0 = time.monotonic()
        fut = self.loop.abort(target)
        fut.add_done_callback(lambda f: self._q.put(("control", target, responder, t0, f)))

    def _take_early_abort(self, rid: str) -> bool:
        with self._abort_lock:
            expiry = self._aborted_early.pop(rid, None)
            now = time.monotonic()
            for k in [k for k, e in self._aborted_early.items() if e < now]:
                del self._aborted_early[k]
        return expiry is not None and expiry >= now

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop admitting, let open requests finish (up to ``timeout``), abort the rest, FINAL all."""
        self._accepting = False
        try:
            self.loop.shutdown(drain=True, timeout=timeout)
        finally:
            self._q.put(_STOP)
            self._thread.join(10.0)
            if self.metrics is not None:
                self.metrics.stop()

    # -- response thread -------------------------------------------------------------------
    def _run(self) -> None:
        next_sweep = time.monotonic() + self.sweep_interval
        while True:
            try:
                item = self._q.get(timeout=self.sweep_interval)
            except queue.Empty:
                item = None
            batch = [] if item is None else [item]
            self._drain(batch)
            if self.stream_interval > 0 and self._only_mid_stream(batch):
                self._linger(batch)
            stop = bool(batch) and batch[-1] is _STOP
            for one in coalesce(batch[:-1] if stop else batch):
                try:
                    self._handle(one)
                except Exception:            # noqa: BLE001 - the thread must survive a bad item
                    log.exception("response thread failed on %r", one[:1] if isinstance(one, tuple) else one)
            if stop:
                self._close_all()
                return
            now = time.monotonic()
            if now >= next_sweep:
                self._sweep(now)
                next_sweep = now + self.sweep_interval

    def _drain(self, batch: list) -> None:
        """Append the queued backlog (merged by coalesce, it costs fewer sends)."""
        while batch and batch[-1] is not _STOP and len(batch) < MAX_DRAIN:
            try:
                batch.append(self._q.get_nowait())
            except queue.Empty:
                return

    def _linger(self, batch: list) -> None:
        """Gather the next steps' tokens of mid-stream requests for up to ``stream_interval``;
        stop waiting as soon as anything else arrives (a first token, a final, a control answer)."""
        deadline = time.monotonic() + self.stream_interval
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                batch.append(self._q.get(timeout=remaining))
            except queue.Empty:
                return
            self._drain(batch)
            if not self._only_mid_stream(batch):
                return

    @staticmethod
    def _only_mid_stream(batch: list) -> bool:
        """True when waiting delays no first token, final or control answer: only later tokens."""
        return bool(batch) and all(
            not isinstance(item[0], str) and item[0].stream and item[0].first_token is not None
            and not item[1].finished for item in batch)

    def _handle(self, item: tuple) -> None:
        head = item[0]
        if head == "open":
            self._open[item[1].rid] = item[1]
        elif head == "reject":
            h, err = item[1], item[2]
            self._open.pop(h.rid, None)
            if self.metrics is not None:
                self.metrics.rejected(err.kind)
            self._finish(h, error=err)
        elif head == "control":
            self._on_control(*item[1:])
        else:
            self._on_delta(item[0], item[1])

    def _on_control(self, target: str, responder: Responder, t0: float, fut) -> None:
        try:
            freed = fut.result()
        except Exception:                    # noqa: BLE001
            freed = None
        if freed is not None or target in self._recent:
            with self._abort_lock:           # it was running (or already done): no tombstone
                self._aborted_early.pop(target, None)
        if freed is not None and self.metrics is not None:
            self.metrics.observe("llm_abort_to_free_seconds", freed - t0)
        try:
            responder.send(control_outputs(freed is not None), final=True)
        except Exception:                    # noqa: BLE001 - the control client went away
            log.debug("abort control answer for %s not delivered", target)

    def _on_delta(self, h: _Open, d: StepDelta) -> None:
        if h.done:
            return
        now = time.monotonic()
        if d.finished:
            h.remaining -= 1
        last = h.remaining <= 0
        if d.finished and self.metrics is not None:
            self.metrics.finished(d.finish_reason or "abort")
        if d.finish_reason == "error" or (d.finish_reason == "abort" and d.error):
            err = tagged(ValueError(d.error) if d.error else RuntimeError("the engine failed this request"))
            if d.error == "deadline exceeded":
                err = unavailable("the request's deadline passed before it finished")
            self._finish(h, error=err, abort_rest=not last)
            return
        if h.cancelled:
            if last:
                self._finish(h)
            return
        if self._client_gone(h, now):
            if last:
                self._finish(h)
            return
        ttft = self._timing(h, d, now)
        try:
            h.responder.send(engine_outputs(d, ttft=ttft), final=last)
        except Exception as exc:             # noqa: BLE001 - the stream is gone: stop generating
            log.debug("send for %s failed: %s", h.rid, exc)
            if last:
                h.done = True
                self._forget(h)
            else:
                self._cancel(h, now)
            return
        if last:
            h.done = True
            self._forget(h)
            if self.metrics is not None and d.finish_reason in ("stop", "length"):
                self.metrics.observe("llm_e2e_request_latency_seconds", now - h.arrival)

    def _timing(self, h: _Open, d: StepDelta, now: float) -> float | None:
        m = self.metrics
        if d.new_token_ids and h.stream:
            if h.first_token is None:
                h.first_token = now
                if m is not None:
                    m.observe("llm_time_to_first_token_seconds", now - h.arrival)
            prev = h.last_token.get(d.index)
            if prev is not None and m is not None:
                m.observe("llm_inter_token_latency_seconds", (now - prev) / len(d.new_token_ids))
            h.last_token[d.index] = now
        if not h.queue_time_seen and (d.new_token_ids or d.completion_tokens):
            h.queue_time_seen = True
            if m is not None:
                m.observe("llm_queue_time_seconds", d.queue_time)
        return None if h.first_token is None else h.first_token - h.arrival

    def _client_gone(self, h: _Open, now: float) -> bool:
        """One is_cancelled() per send (an IPC round trip); on a cancel, abort in the engine."""
        h.last_check = now
        try:
            gone = h.responder.is_cancelled()
        except Exception:                    # noqa: BLE001
            gone = True
        if gone:
            self._cancel(h, now)
        return gone

    def _cancel(self, h: _Open, now: float) -> None:
        h.cancelled = True
        fut = self.loop.abort(h.rid)
        m = self.metrics
        if m is not None:
            def freed(f) -> None:            # runs on the engine thread: only a queue put
                if not f.cancelled() and f.exception() is None and f.result() is not None:
                    m.observe("llm_abort_to_free_seconds", f.result() - now)
            fut.add_done_callback(freed)

    def _sweep(self, now: float) -> None:
        """Requests that send nothing for a while (queued, non-streaming) are checked here."""
        for h in list(self._open.values()):
            if not h.done and not h.cancelled and now - h.last_check >= self.sweep_interval:
                self._client_gone(h, now)

    def _finish(self, h: _Open, *, error: RequestError | None = None, abort_rest: bool = False) -> None:
        """Send the request's one FINAL (with an error response if given)."""
        if h.done:
            return
        h.done = True
        if abort_rest and getattr(self.loop, "healthy", True):
            self.loop.abort(h.rid)
        try:
            h.responder.send(None, error=error, final=True)
        except Exception as exc:             # noqa: BLE001
            log.debug("final for %s not delivered: %s", h.rid, exc)
        self._forget(h)

    def _forget(self, h: _Open) -> None:
        if self._open.get(h.rid) is h:
            del self._open[h.rid]
        self._recent[h.rid] = time.monotonic()
        while len(self._recent) > 4096:
            self._recent.popitem(last=False)

    def _close_all(self) -> None:
        """Shutdown: apply what is queued, then end every request still open."""
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                try:
                    self._handle(item)
                except Exception:            # noqa: BLE001
                    log.exception("response thread failed while closing")
        for h in list(self._open.values()):
            self._finish(h, error=None if h.cancelled else unavailable("the server shut down"))


def build_engine_service(model_dir: str, params: dict[str, str], *, metrics_factory: Any = None,
                         labels: dict[str, str] | None = None) -> EngineService:
    """Engine + loop + metrics + service from the engine model's config parameters."""
    from dataclasses import fields

    from backend.config import EngineArgs
    from backend.engine.engine_loop import EngineLoop
    from backend.engine.llm_engine import LLMEngine
    from backend.serving.metrics import ServingMetrics

    known = {f.name for f in fields(EngineArgs)}
    args = EngineArgs.from_dict({k: v for k, v in params.items() if k in known})
    engine = LLMEngine(model_dir, args)
    loop = EngineLoop(engine)
    metrics = None
    if metrics_factory is not None:
        metrics = ServingMetrics(metrics_factory, stats=loop.stats, healthy=lambda: loop.healthy,
                                 labels=labels)
    service = EngineService(loop, max_model_len=engine.max_model_len, metrics=metrics,
                            stream_interval=args.stream_interval)
    return service
