"""The one place a measurement attaches to a request's path.

The product calls ``mark(request_id, event)`` at the hops of a request's way to its first token
(shim, preprocessing, engine model, engine loop, response thread) and installs no hook, so a mark
is one global test. A lab tool attaches a callback from outside (``bench/ttft_trace.py``, loaded
into every serving process through ``bench/attach/sitecustomize.py``); nothing here knows it.
"""
from __future__ import annotations

from typing import Callable, Optional

Hook = Callable[[str, str, Optional[float]], None]   # (request id, event, time.monotonic() or None: now)

hook: Hook | None = None


def attach(callback: Hook | None) -> None:
    """Install ``callback`` for every later mark (None detaches)."""
    global hook
    hook = callback


def mark(request_id: str, event: str, at: float | None = None) -> None:
    h = hook
    if h is not None:
        h(request_id, event, at)
