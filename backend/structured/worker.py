"""CompileWorker: grammar compiles on their own thread, off the engine's path, each waiter with a
wall-clock budget.

xgrammar 0.2.9 releases the GIL while it compiles (measured with SmolLM2's vocabulary: a Python
thread ticking every 1 ms saw gaps of at most 9 ms during a 2 s compile), so a thread is enough:
the engine thread keeps stepping while a grammar compiles, and the result needs no serializing.

    submit(key, fn) -> Future    one per waiting request; waiters of one key share one compile
    [grammar-compile]  runs jobs in arrival order; a job whose waiters all ran out of budget
                       while it queued is skipped. It keeps its creator's nice value: the engine
                       thread raises its own priority where it may (TRITON_LLM_ENGINE_NICE), and
                       a lowered compile thread starved behind it and every other job on a
                       2-core host (all 8 slow regexes of the e2e test timed out at +5)
    [grammar-deadline] fails each waiter ``budget_s`` after it was submitted (BudgetExceeded)

A compile cannot be interrupted once it runs: past the budget its waiters are answered at once,
and the compile finishes in the background (its result is still cached). The caps in caps.py keep
what may run that long bounded; the budget covers the queue wait too, so a backlog of slow
grammars never grows past what arrives within one budget.
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from typing import Any, Callable, Hashable



class BudgetExceeded(Exception):
    """A waiter's budget ran out; ``started`` tells whether its compile had begun (else it queued)."""

    def __init__(self, budget_s: float, started: bool):
        super().__init__(f"not compiled within {budget_s:g} s")
        self.budget_s = budget_s
        self.started = started


class _Job:
    __slots__ = ("key", "fn", "waiters", "started")

    def __init__(self, key: Hashable, fn: Callable[[], Any]):
        self.key, self.fn = key, fn
        self.waiters: list[Future] = []
        self.started = False


def resolve(fut: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Set a future once; the loser of a race (compile vs deadline) is a no-op."""
    if fut.done():
        return
    try:
        fut.set_exception(error) if error is not None else fut.set_result(result)
    except InvalidStateError:
        pass


class CompileWorker:
    def __init__(self, budget_s: float, *, clock: Callable[[], float] = time.monotonic):
        self.budget_s = float(budget_s)
        self._clock = clock
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._jobs: dict[Hashable, _Job] = {}          # queued or running, by key
        self._deadlines: list[tuple[float, int, Future, _Job]] = []
        self._seq = itertools.count()
        self._threads: list[threading.Thread] = []
        self._worker_ident: int | None = None
        self._closed = False
        self.compiled = 0            # jobs run
        self.skipped = 0             # jobs dropped unrun: every waiter's budget ran out first

    def submit(self, key: Hashable, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the grammar compile worker is closed")
            if not self._threads:
                self._start()
            job = self._jobs.get(key)
            if job is None:
                job = self._jobs[key] = _Job(key, fn)
                self._queue.append(job)
            job.waiters.append(fut)
            heapq.heappush(self._deadlines, (self._clock() + self.budget_s, next(self._seq), fut, job))
            self._cond.notify_all()
        return fut

    def on_worker_thread(self) -> bool:
        return threading.get_ident() == self._worker_ident

    @property
    def pending(self) -> int:
        """Jobs queued or running."""
        return len(self._jobs)

    def close(self) -> None:
        """Stop both threads; queued jobs' waiters fail (a running compile finishes unobserved)."""
        with self._cond:
            self._closed = True
            queued = [w for job in self._queue for w in job.waiters]
            self._queue.clear()
            self._cond.notify_all()
        for w in queued:
            resolve(w, error=RuntimeError("the grammar compile worker is closed"))

    # -- threads ---------------------------------------------------------------------------------
    def _start(self) -> None:
        for target, name in ((self._work, "grammar-compile"), (self._watch, "grammar-deadline")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def _work(self) -> None:
        self._worker_ident = threading.get_ident()
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
                if all(w.done() for w in job.waiters):
                    del self._jobs[job.key]
                    self.skipped += 1
                    continue
                job.started = True
            result, error = None, None
            try:
                result = job.fn()
            except BaseException as exc:          # noqa: BLE001 - handed to every waiter
                error = exc
            with self._cond:
                self._jobs.pop(job.key, None)
                waiters = list(job.waiters)
                self.compiled += 1
            for w in waiters:
                resolve(w, result, error)

    def _watch(self) -> None:
        while True:
            with self._cond:
                now = self._clock()
                expired = []
                while self._deadlines and self._deadlines[0][0] <= now:
                    _, _, fut, job = heapq.heappop(self._deadlines)
                    if not fut.done():
                        expired.append((fut, job.started))
                if not expired:
                    if self._closed:
                        return
                    self._cond.wait(self._deadlines[0][0] - now if self._deadlines else None)
                    continue
            for fut, started in expired:           # outside the lock: callbacks may submit
                resolve(fut, error=BudgetExceeded(self.budget_s, started))
