"""Child processes that never outlive us: own process group, SIGTERM on parent death, group stop.

A server is started in its own session (process group) so :func:`terminate_group` can end it
together with the processes it started (tritonserver's Python-backend stubs); it also gets SIGTERM
when the starting process dies (Linux ``PR_SET_PDEATHSIG``), so a killed test run leaves no orphans.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import socket
import subprocess
import time

from common import env


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_port(host: str, port: int, proc: subprocess.Popen, timeout: float) -> bool:
    """True once ``host:port`` accepts a connection; False if ``proc`` exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.2)
    return False


def wait_http_ok(url: str, proc: subprocess.Popen, timeout: float) -> bool:
    """True once ``GET url`` answers 200; False if ``proc`` exits or ``timeout`` passes."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    return False


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the parent dies (best effort, Linux only)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


@contextlib.contextmanager
def scoped_environ(overrides: dict[str, str | None]):
    """The environment with ``overrides`` (None: unset) while the block runs, as it was after: the
    environment that servers started in the block (tritonserver and its stubs, the shim) inherit."""
    now = env.snapshot()
    saved = {k: now.get(k) for k in overrides}
    env.update(overrides)
    try:
        yield
    finally:
        env.update(saved)


def spawn(cmd: list[str], log_path: pathlib.Path, *, cwd: str | os.PathLike,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``cmd`` in its own process group, stdout and stderr to ``log_path``."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=cwd, start_new_session=True, preexec_fn=_die_with_parent)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def terminate_group(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """Stop ``proc`` and everything in its process group.

    SIGTERM goes to the leader alone first: tritonserver then drains open requests and stops its
    Python-backend stubs itself (a stub signalled directly would die mid-stream). Whatever is left
    after ``timeout`` seconds, or after the leader exited, gets SIGTERM and then SIGKILL.
    """
    pgid = proc.pid
    try:
        proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 2.0)):
        if not group_alive(pgid):
            break
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and group_alive(pgid):
            proc.poll()
            time.sleep(0.05)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
