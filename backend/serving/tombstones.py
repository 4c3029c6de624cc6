"""Explicit aborts that arrive before their request, and the ids of requests that already finished.

Inside the ``llm`` ensemble a client's abort goes straight to the engine model while its request
may still be in preprocessing. Such an abort leaves a tombstone for ``ttl`` seconds; the request,
when it arrives, is answered with ``finish_reason="abort"`` without running. An abort whose target
is running (the engine freed it) or already finished leaves none, so a later request that reuses
the id runs normally.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable

RECENT = 4096                               # finished ids remembered (an abort after finish is a no-op)


class AbortTombstones:
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
