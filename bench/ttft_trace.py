"""Where a request's first token spends its time in the engine: an opt-in trace.

Attached from outside the product: a stack started with the interpreter of ``python -m
bench.lab_venv`` and ``LLM_TTFT_TRACE=<dir>`` in its environment (the stubs inherit tritonserver's)
sets ``record`` as the engine loop's one hook (``backend.engine.engine_loop.trace``, None in the
product), which records ``(request id, event, time.monotonic())`` -- one clock for every process
of the host -- and a daemon thread appends them as JSON lines to ``<dir>/<process>-<pid>.jsonl``
about every 0.2 s. A client may record its own ``client.send`` / ``client.tok0`` the same way.
Events:

    loop.add         the engine thread applied the add loop.step0 the step that sampled token 1 started
    loop.tok0        that step's deltas are ready

``report(dir)`` joins them per request id (a shim request's id is the ensemble's) and prints the
median gap between consecutive events: ``python -m bench.ttft_trace <dir>``.
"""
from __future__ import annotations

import collections
import json
import os
import pathlib
import statistics
import sys
import threading
import time

ENV = "LLM_TTFT_TRACE"
ORDER = ("client.send", "loop.add", "loop.step0", "loop.tok0", "client.tok0")

_buf: collections.deque = collections.deque()
_started = False
_lock = threading.Lock()
_dir: pathlib.Path | None = None


def attach_from_env() -> None:
    """Set ``record`` as the engine loop's hook when ``LLM_TTFT_TRACE`` names a directory."""
    global _dir
    if os.environ.get(ENV):
        from backend.engine import engine_loop

        _dir = pathlib.Path(os.environ[ENV])
        engine_loop.trace = record


def record(rid: str, event: str, at: float | None = None) -> None:
    """Record ``event`` for request ``rid`` now (or at ``at``)."""
    _buf.append((rid, event, time.monotonic() if at is None else at))
    if not _started:
        _start()


def _start() -> None:
    global _started
    with _lock:
        if _started:
            return
        _started = True
    name = pathlib.Path(sys.argv[0] or "python").name or "python"
    path = (_dir or pathlib.Path(os.environ[ENV])) / f"{name}-{os.getpid()}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)

    def flush() -> None:
        while True:
            time.sleep(0.2)
            lines = []
            while _buf:
                lines.append(json.dumps(_buf.popleft()))
            if lines:
                with open(path, "a") as f:
                    f.write("\n".join(lines) + "\n")

    threading.Thread(target=flush, name="ttft-trace", daemon=True).start()


def load(directory: str | os.PathLike) -> dict[str, dict[str, float]]:
    """request id -> event -> time (the first of each event)."""
    out: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for p in pathlib.Path(directory).glob("*.jsonl"):
        for line in p.read_text().splitlines():
            rid, event, at = json.loads(line)
            out[rid].setdefault(event, at)
    return out


def report(directory: str | os.PathLike) -> str:
    reqs = load(directory)
    gaps: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    totals = []
    for events in reqs.values():
        seq = [e for e in ORDER if e in events]
        for a, b in zip(seq, seq[1:]):
            gaps[(a, b)].append(events[b] - events[a])
        if len(seq) >= 2:
            totals.append(events[seq[-1]] - events[seq[0]])
    lines = [f"{len(reqs)} requests; median gap between consecutive events (ms):"]
    for (a, b), v in sorted(gaps.items(), key=lambda kv: ORDER.index(kv[0][0])):
        lines.append(f"  {a:>11} -> {b:<11} {statistics.median(v) * 1e3:7.3f}   (n={len(v)})")
    if totals:
        lines.append(f"  first -> last event      {statistics.median(totals) * 1e3:7.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(sys.argv[1]))
