"""``triton-llm serve --replicas 2`` as a user runs it, on this host's CPUs: it sizes the replicas to
fit and becomes ready, its Ray cluster takes a token and listens on loopback only, and SIGTERM
stops everything it started, whether the deployment is still starting or it serves.

Each run gets its own short TMPDIR: Ray's session, the replicas' workdirs and every process the
run starts (Ray's, the replicas' tritonservers and their stubs) carry it in their environment, so
"what is left" is exactly the processes that hold it.
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from backend.serving.process_group import free_port
from tests.conftest import E2E_ENGINE_OPTIONS, ROOT, model_dir

pytestmark = pytest.mark.e2e
ray = pytest.importorskip("ray")

LOOPBACK = ("127.0.0.1", "[::ffff:127.0.0.1]", "[::1]")


class Run:
    def __init__(self, *args: str) -> None:
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="tllm-rs-", dir="/tmp"))   # short: Ray's socket paths
        self.log = self.dir / "serve.log"
        self.port = free_port()
        opts = [a for k, v in E2E_ENGINE_OPTIONS.items() for a in ("--engine-option", f"{k}={v}")]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "TRITON_LLM_"))}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "triton_llm.cli", "serve", "--model", str(model_dir("tiny")),
                 "--shim-port", str(self.port), *opts, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                env={**env, "TMPDIR": str(self.dir)}, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def ours(self) -> list[int]:
        marker = f"TMPDIR={self.dir}".encode()
        out = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if marker in pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    out.append(int(pid))
            except OSError:
                pass
        return out

    def wait_for(self, what, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"serve --replicas: not reached (exit {self.proc.poll()}):\n{self.text()[-4000:]}")
            time.sleep(0.5)

    def terminate(self) -> float:
        """SIGTERM; seconds until no process of the run is left (fails past 60 s)."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        while self.ours() and time.monotonic() - t0 < 60:
            time.sleep(0.2)
        took = time.monotonic() - t0
        assert not self.ours(), f"left after SIGTERM: {self.ours()}\n{self.text()[-3000:]}"
        assert self.proc.wait(timeout=5) == 0
        return took

    def close(self) -> None:
        for pid in self.ours():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _tritonservers(run: Run) -> list[int]:
    return [p for p in run.ours() if pathlib.Path(f"/proc/{p}/comm").read_text().strip() == "tritonserver"]


def _listening(pids: list[int]) -> list[tuple[str, int, str]]:
    """(local address, port, process name) of every listening TCP socket of ``pids``."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        if any(f"pid={p}," in line for p in pids):
            addr, port = line.split()[3].rsplit(":", 1)
            found.append((addr, int(port), line.split('"')[1]))
    return found


def _ray_driver(gcs: str, env: dict) -> str:
    """Output of a driver joining the cluster at ``gcs`` with ``env``'s auth settings ("CONNECTED"
    once in). Single-machine mode as the cluster's, so only the auth settings differ."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    code = f"import ray; ray.init(address={gcs!r}, logging_level='ERROR'); print('CONNECTED', flush=True)"
    try:
        r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                           env={**clean, **env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                                "HOME": tempfile.gettempdir()})
    except subprocess.TimeoutExpired as exc:
        return f"timed out: {exc.stderr}"
    return r.stdout + r.stderr


def test_two_replicas_fit_the_host_are_locked_down_and_stop_on_sigterm():
    import openai

    run = Run("--replicas", "2")
    try:
        run.wait_for(lambda: "Ctrl-C to stop" in run.text(), timeout=900)
        each, ingress = map(float, re.search(r"\(([\d.]+) Ray CPUs each, ingress ([\d.]+)\)", run.text()).groups())
        assert ingress + 2 * each <= os.cpu_count()               # sized to the host: nothing pending
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{run.port}/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=4, temperature=0)
        assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens >= 1

        # every port of the stack (Ray's GCS, raylet, workers, agents, Serve's proxy, tritonservers)
        listening = _listening(run.ours())
        names = {name for _, _, name in listening}
        assert {"gcs_server", "raylet", "tritonserver"} <= names, listening
        assert all(addr in LOOPBACK for addr, _, _ in listening), listening
        # Ray takes its token: a driver without it is not admitted, one with it is
        gcs = next(f"127.0.0.1:{port}" for _, port, name in listening if name == "gcs_server")
        token_path = next(v.split(b"=", 1)[1].decode() for pid in run.ours() if pid != run.proc.pid
                          for v in pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                          if v.startswith(b"RAY_AUTH_TOKEN_PATH="))      # what Ray's processes got
        assert oct(pathlib.Path(token_path).stat().st_mode & 0o777) == "0o600"
        for auth in ({"RAY_AUTH_MODE": "disabled"}, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}):
            out = _ray_driver(gcs, auth)
            assert "CONNECTED" not in out and "InvalidAuthToken" in out, out[-2000:]
        assert "CONNECTED" in _ray_driver(gcs, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_path})

        took = run.terminate()
        print(f"SIGTERM once serving: everything gone in {took:.1f} s")
        assert not pathlib.Path(token_path).exists()
    finally:
        run.close()


def test_sigterm_while_the_replicas_are_still_starting_stops_everything():
    run = Run("--replicas", "2")
    try:
        # the replicas' tritonservers are up but the application is not running yet
        run.wait_for(lambda: len(_tritonservers(run)) == 2, timeout=600)
        assert "Ctrl-C to stop" not in run.text()
        took = run.terminate()
        print(f"SIGTERM while deploying: everything gone in {took:.1f} s")
    finally:
        run.close()


def test_replica_cpus_that_cannot_fit_are_refused_at_once():
    run = Run("--replicas", "2", "--replica-cpus", str(os.cpu_count()))
    try:
        assert run.proc.wait(timeout=180) == 2
        assert "--replica-cpus to at most" in run.text() and "Ctrl-C to stop" not in run.text()
        deadline = time.monotonic() + 30
        while run.ours() and time.monotonic() < deadline:       # its Ray cluster goes too
            time.sleep(0.2)
        assert not run.ours()
    finally:
        run.close()
