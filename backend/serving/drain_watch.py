"""The launcher's drain reaches the engine: open requests are cut at the drain deadline.

Triton unloads a model only after its open requests are released, and a decoupled request is
released at its FINAL, so an unload never reaches the engine while streams run: it cannot tell
the engine "cut them now". The launcher (``TritonServer.drain``) therefore writes the deadline,
in seconds from now, into the file named by the engine option ``drain_file`` (set by the
launcher, never by a client). This thread polls for it; once it appears the engine admits
nothing new, lets open requests run until the deadline and then aborts them (each stream ends
with ``finish_reason="abort"``), so the ensemble finishes, every model unloads and tritonserver
exits on its own instead of being killed.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Callable

log = logging.getLogger(__name__)


class DrainWatch:
    def __init__(self, path: str, on_drain: Callable[[float], None], interval: float = 0.1) -> None:
        self.path = path
        self.on_drain = on_drain            # called once with the seconds left until the deadline
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llm-drain-watch", daemon=True)

    def start(self) -> "DrainWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if not os.path.exists(self.path):
                continue
            try:
                with open(self.path) as f:
                    seconds = max(0.0, float(f.read().strip() or 0))
            except (OSError, ValueError):
                seconds = 0.0
            log.info("drain requested: open requests are cut in %.1fs", seconds)
            self.on_drain(seconds)
            return


def write_drain(path: str | os.PathLike, seconds: float) -> None:
    """The launcher's side: atomically publish the deadline."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{seconds:.3f}")
    os.replace(tmp, path)


def remove_drain(path: str | os.PathLike) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


__all__ = ["DrainWatch", "write_drain", "remove_drain"]
