"""A peer's HTTP server as a context manager: started in its own session, healthy (``/health``
answers 200) or an error naming its log, and its whole process group stopped on exit (vLLM's API
server forks an engine-core process)."""
from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess

from backend.serving.process_group import wait_http_ok


class PeerServer:
    name = "peer"

    def __init__(self, cmd: list[str], port: int, log: pathlib.Path, *, start_timeout: float,
                 cwd: pathlib.Path | None = None, stop_grace: float = 30.0) -> None:
        self.cmd, self.port, self.log, self.cwd = cmd, port, log, cwd
        self.start_timeout, self.stop_grace = start_timeout, stop_grace
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self):
        self.proc = subprocess.Popen(self.cmd, cwd=self.cwd, stdout=open(self.log, "wb"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        if wait_http_ok(f"http://127.0.0.1:{self.port}/health", self.proc, self.start_timeout):
            return self
        code = self.proc.poll()
        self.__exit__()
        raise RuntimeError(f"{self.name} exited ({code}); see {self.log}" if code is not None else
                           f"{self.name} not healthy within {self.start_timeout:.0f} s; see {self.log}")

    def __exit__(self, *exc) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(self.stop_grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
