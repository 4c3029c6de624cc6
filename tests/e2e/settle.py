"""Wait for Triton's ``llm_`` metrics to settle before reading exact values or deltas.

The engine model's metrics thread writes them off the hot path (backend/serving/metrics.py): the
gauges after each batch, the histograms and token/abort counters at a 0.1 s poll, one IPC write
per series. So a scrape can see ``running == 0`` while the counters of the request that just ended
(or of the previous test's) are not written yet, or a poll half written. On a loaded 2-core CI
host the thread can lag by far more than one poll. ``settled`` returns a snapshot only once a
condition holds AND no ``llm_`` value changed for ``quiet`` seconds (many polls), so a ``before``
snapshot holds everything earlier and an ``after`` snapshot everything the test did.

    snap = settled(lambda: scrape(server), ready=lambda s: metric(s, "llm_num_requests_running") == 0)
    snap = settled(lambda: llm_values(metrics_url))         # tests/e2e/shim_fixtures style
"""
from __future__ import annotations

import time
from typing import Callable

import httpx

from load.counters import parse_prometheus

QUIET_S = 1.0


def llm_values(metrics_url: str) -> dict[str, float]:
    """Every ``llm_`` series on a metrics endpoint, summed over its label sets."""
    text = httpx.get(metrics_url, timeout=30).text
    return {k: v for k, v in parse_prometheus(text).items() if k.startswith("llm_")}


def settled(read: Callable[[], dict], *, ready: Callable[[dict], bool] = lambda s: True,
            quiet: float = QUIET_S, timeout: float = 120.0, interval: float = 0.1) -> dict:
    """``read()`` once ``ready(snapshot)`` holds and the snapshot stayed equal for ``quiet`` s."""
    deadline = time.monotonic() + timeout
    last, since = None, 0.0
    while True:
        snap = read()
        now = time.monotonic()
        if ready(snap) and snap == last:
            if now - since >= quiet:
                return snap
        else:
            last, since = snap, now
        if now > deadline:
            raise AssertionError(f"metrics did not settle (ready={ready(snap)}) within {timeout}s: "
                                 f"{ {k: v for k, v in snap.items() if 'bucket' not in str(k)} }")
        time.sleep(interval)
