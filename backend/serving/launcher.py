"""Start tritonserver on a generated model repository (and, for ``triton-llm serve``, the OpenAI shim).

    with TritonServer(model_dir) as server:      # picks free ports, waits for readiness
        client = grpcclient.InferenceServerClient(server.grpc_url)

The server runs in its own process group so :meth:`TritonServer.stop` can end it together with its
Python-backend stub processes (SIGTERM, then SIGKILL); it also gets SIGTERM when the starting
process dies (Linux ``PR_SET_PDEATHSIG``), so a killed test run leaves no orphan servers.
"""
from __future__ import annotations

import os
import pathlib
import json
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from backend.serving.install import backend_directory, find_tritonserver, server_env
from backend.serving.repository import TEMPLATES, generate_repository, parse_engine_options

ROOT = pathlib.Path(__file__).resolve().parents[2]
ADMIN_HEADER = "triton-llm-admin"
SERVE_DRAIN_SECONDS = 60          # open streams may finish for this long after SIGTERM
HEALTH_INTERVAL = 5.0


class ServerStartError(RuntimeError):
    """tritonserver exited or did not become ready; the message ends with its log's tail."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_tail(path: pathlib.Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


# Errors tritonserver logs on every CPU-only start; they say nothing about why a start failed.
_HARMLESS = ("CudaDriverHelper has not been initialized", "Unable to allocate pinned system memory",
             "CUDA driver version is insufficient")


def log_errors(path: pathlib.Path, limit: int = 20) -> list[str]:
    """The lines of a tritonserver log that say what went wrong (load failures, parse errors)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        if any(h in line for h in _HARMLESS):
            continue
        if re.match(r"^E\d{4} ", line) or "ERROR" in line or line.startswith("error:") or "UNAVAILABLE:" in line:
            found.append(line.strip()[:2000])
    return found[-limit:]


def failure_report(path: pathlib.Path) -> str:
    errors = log_errors(path)
    reason = "\n".join(errors) if errors else "(no error lines logged)"
    return f"errors logged:\n{reason}\nlast lines of {path}:\n{log_tail(path, 15)}"


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the parent dies (best effort, Linux only)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _group_alive(pgid: int) -> bool:
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
        if not _group_alive(pgid):
            break
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _group_alive(pgid):
            proc.poll()
            time.sleep(0.05)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


class TritonServer:
    """A tritonserver process serving the project's model repository for one checkpoint."""

    def __init__(self, model_dir: str | os.PathLike, *, host: str = "127.0.0.1",
                 http_port: int | None = None, grpc_port: int | None = None,
                 metrics_port: int | None = None, engine_options: list[str] | dict | None = None,
                 models: list[str] | None = None, instances: dict[str, int] | None = None,
                 workdir: str | os.PathLike | None = None, repository_src: str | os.PathLike = TEMPLATES,
                 startup_timeout: float = 180.0, log_verbose: int = 0, quiet: bool = False,
                 exit_timeout: int = 10) -> None:
        self.model_dir = pathlib.Path(model_dir)
        self.host = host
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.engine_options = parse_engine_options(engine_options)
        self.models = models
        self.instances = instances
        self._own_workdir = workdir is None
        self.workdir = pathlib.Path(workdir or tempfile.mkdtemp(prefix="triton-llm-"))
        self.repository_src = pathlib.Path(repository_src)
        self.startup_timeout = startup_timeout
        self.log_verbose = log_verbose
        self.quiet = quiet
        self.exit_timeout = exit_timeout      # tritonserver waits this long for open requests on SIGTERM
        self.log_path = self.workdir / "tritonserver.log"
        self.proc: subprocess.Popen | None = None
        self._admin_key = secrets.token_hex(16)

    # -- addresses -------------------------------------------------------------------------------
    @property
    def _client_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host

    @property
    def grpc_url(self) -> str:
        return f"{self._client_host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{self._client_host}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self._client_host}:{self.metrics_port}/metrics"

    # -- lifecycle -------------------------------------------------------------------------------
    def command(self) -> list[str]:
        install = find_tritonserver()
        backends = backend_directory(install, self.workdir)
        repo = generate_repository(self.workdir / "model_repository", self.model_dir,
                                   engine_options=self.engine_options, models=self.models,
                                   instances=self.instances, src=self.repository_src)
        self._install = install
        return [
            str(install.binary),
            f"--model-repository={repo}",
            f"--backend-directory={backends}",
            # Separate shared-memory names per server, so several servers can run on one machine.
            f"--backend-config=python,shm-region-prefix-name=tllm{os.getpid()}_{self.grpc_port}_",
            f"--http-address={self.host}", f"--http-port={self.http_port}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            f"--log-verbose={self.log_verbose}",
            "--exit-on-error=true", "--strict-readiness=true",
            f"--exit-timeout-secs={self.exit_timeout}",
            # Explicit model control only so drain() can unload models (in-flight requests finish,
            # new ones are refused); the repository API is locked behind a per-run admin key.
            "--model-control-mode=explicit", "--load-model=*",
            f"--http-restricted-api=model-repository:{ADMIN_HEADER}={self._admin_key}",
            f"--grpc-restricted-protocol=model-repository:{ADMIN_HEADER}={self._admin_key}",
        ] + (["--allow-gpu-metrics=false"] if install.wheel_root is not None else [])

    def start(self) -> "TritonServer":
        if self.proc is not None:
            raise RuntimeError("already started")
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = self.command()
        env = server_env(self._install)
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=self.workdir, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _say(self, msg: str) -> None:
        if not self.quiet:
            print(f"[triton-llm] {msg}", file=sys.stderr, flush=True)

    def _wait_ready(self) -> None:
        t0 = time.monotonic()
        next_note = t0 + 5.0
        url = f"http://{self.http_url}/v2/health/ready"
        self._say(f"starting tritonserver (log: {self.log_path})")
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerStartError(
                    f"tritonserver exited with code {code} before becoming ready "
                    f"(a model failed to load?)\n{failure_report(self.log_path)}")
            if self.is_ready(url):
                self._say(f"tritonserver ready after {time.monotonic() - t0:.1f}s "
                          f"(grpc {self.grpc_url}, http {self.http_url}, metrics {self.metrics_url})")
                return
            now = time.monotonic()
            if now - t0 > self.startup_timeout:
                raise ServerStartError(
                    f"tritonserver not ready after {self.startup_timeout:.0f}s\n{failure_report(self.log_path)}")
            if now >= next_note:
                last = log_tail(self.log_path, 1).strip()[:160]
                self._say(f"waiting for tritonserver ({now - t0:.0f}s) {last}")
                next_note = now + 5.0
            time.sleep(0.2)

    @staticmethod
    def is_ready(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def engine_healthy(self) -> bool | None:
        """The engine model's ``llm_engine_healthy`` gauge (None when it cannot be read)."""
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2.0) as r:
                text = r.read().decode()
        except (urllib.error.URLError, OSError):
            return None
        m = re.search(r"^llm_engine_healthy\{[^}]*\}\s+(\S+)$", text, re.M)
        return None if m is None else float(m.group(1)) > 0

    def _admin(self, path: str, body: dict | None = None) -> object:
        req = urllib.request.Request(f"http://{self.http_url}{path}", method="POST",
                                     data=json.dumps(body or {}).encode(),
                                     headers={ADMIN_HEADER: self._admin_key, "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read().decode()
        return json.loads(text) if text else None

    def drain(self, timeout: float = 60.0, models: tuple[str, ...] = ("llm", "engine")) -> bool:
        """Refuse new generation requests and wait (up to ``timeout``) for open ones to finish.

        Unloading a model makes Triton refuse new requests for it while requests already in flight
        complete normally (the front ends stay up, so streams keep flowing). True when drained.
        """
        if not self.alive():
            return True
        try:
            loaded = {m["name"] for m in self._admin("/v2/repository/index", {"ready": True})}
            targets = [m for m in models if m in loaded]
            for m in targets:
                self._admin(f"/v2/repository/models/{m}/unload")
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.alive():
                index = {m["name"]: m.get("state", "") for m in self._admin("/v2/repository/index")}
                if all(index.get(m) == "UNAVAILABLE" for m in targets):
                    return True
                time.sleep(0.2)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            self._say(f"drain failed: {exc}")
        return False

    def stop(self, grace: float | None = None) -> None:
        """SIGTERM; after ``grace`` seconds (default: the exit timeout + 15) SIGKILL what is left."""
        if self.proc is None:
            return
        terminate_group(self.proc, timeout=self.exit_timeout + 15 if grace is None else grace)
        self.proc = None
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _wait_port(host: str, port: int, proc: subprocess.Popen, timeout: float) -> bool:
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


def start_shim(args, server: TritonServer, workdir: pathlib.Path) -> subprocess.Popen | None:
    """Start the OpenAI shim (client/shim) if it exists; None (with a note) otherwise."""
    if not args.shim_port:
        return None
    if not (ROOT / "client" / "shim" / "__main__.py").exists():
        print("[triton-llm] note: client/shim is not present; serving Triton only", file=sys.stderr)
        return None
    cmd = [sys.executable, "-m", "client.shim", "--triton-grpc", server.grpc_url,
           "--host", args.host, "--port", str(args.shim_port), "--model-dir", str(server.model_dir)]
    if args.api_keys:
        cmd += ["--api-keys", args.api_keys]
    log = open(workdir / "shim.log", "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=_die_with_parent)
    log.close()
    host = "127.0.0.1" if args.host in ("0.0.0.0", "") else args.host
    if not _wait_port(host, args.shim_port, proc, timeout=60):
        tail = log_tail(workdir / "shim.log")
        terminate_group(proc, timeout=5)
        raise ServerStartError(f"the OpenAI shim did not start; last lines of {workdir / 'shim.log'}:\n{tail}")
    return proc


def serve_main(args) -> int:
    """``triton-llm serve``: tritonserver + OpenAI shim until Ctrl-C / SIGTERM."""
    workdir = pathlib.Path(args.workdir) if args.workdir else ROOT / "build" / "serve"
    workdir.mkdir(parents=True, exist_ok=True)

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    server = TritonServer(args.model, host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                          metrics_port=args.metrics_port, engine_options=args.engine_option,
                          workdir=workdir, exit_timeout=SERVE_DRAIN_SECONDS)
    shim = None
    stop_grace = None
    try:
        server.start()
        shim = start_shim(args, server, workdir)
        print(f"tritonserver  grpc {server.grpc_url}  http {server.http_url}  metrics {server.metrics_url}")
        print("  models: llm (ensemble, text), engine (token ids), preprocessing, postprocessing")
        if shim is not None:
            host = "127.0.0.1" if args.host in ("0.0.0.0", "") else args.host
            print(f"OpenAI API    http://{host}:{args.shim_port}/v1   (log: {workdir / 'shim.log'})")
            print(f"chat page     http://{host}:{args.shim_port}/")
        print("Ctrl-C to stop.", flush=True)
        next_health = time.monotonic() + HEALTH_INTERVAL
        while True:
            if not server.alive():
                print(f"tritonserver exited; last lines of {server.log_path}:\n{log_tail(server.log_path)}",
                      file=sys.stderr)
                return 1
            if shim is not None and shim.poll() is not None:
                print(f"the shim exited; last lines of {workdir / 'shim.log'}:\n{log_tail(workdir / 'shim.log')}",
                      file=sys.stderr)
                return 1
            if time.monotonic() >= next_health:
                next_health = time.monotonic() + HEALTH_INTERVAL
                if server.engine_healthy() is False:
                    # The model cannot flip Triton's readiness; exiting lets a supervisor restart us.
                    print("[triton-llm] the engine loop died (llm_engine_healthy 0); stopping so a "
                          f"supervisor can restart the server. Log: {server.log_path}", file=sys.stderr)
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        print(f"\n[triton-llm] draining open requests (up to {SERVE_DRAIN_SECONDS}s), then stopping",
              file=sys.stderr)
        try:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)   # a second Ctrl-C would orphan the drain
            drained = server.drain(SERVE_DRAIN_SECONDS)
            stop_grace = 10.0 if drained else 5.0   # what is left now is stuck (e.g. an idle client stream)
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        return 0
    except (ServerStartError, ValueError, FileNotFoundError) as exc:
        print(f"[triton-llm] error: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if shim is not None:
            terminate_group(shim, timeout=5)
        server.stop(grace=stop_grace)
