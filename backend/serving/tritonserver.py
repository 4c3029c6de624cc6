"""One tritonserver process serving the project's model repository for one checkpoint.

    with TritonServer(model_dir) as server:      # picks free ports, waits for readiness
        client = grpcclient.InferenceServerClient(server.grpc_url)

``start()`` finds the install, renders the repository, spawns the server in its own process group
(process_group.py; its admin key off the command line, argv_secret.py) and waits until it is ready;
``drain()`` unloads the generation models so open requests finish and new ones are refused;
``stop()`` ends the whole group; ``restart()`` starts a server that exited again on the same ports.
"""
from __future__ import annotations

import json
import os
import pathlib
import secrets
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from backend.serving.argv_secret import hide
from backend.serving.drain_watch import remove_drain, write_drain
from backend.serving.install import TritonInstall, backend_directory, find_tritonserver, server_env
from backend.serving.process_group import free_port, spawn, terminate_group
from backend.serving.repository import TEMPLATES, generate_repository, parse_engine_options
from backend.serving.server_log import failure_report, log_tail

ADMIN_HEADER = "triton-llm-admin"


class ServerStartError(RuntimeError):
    """tritonserver exited or did not become ready; the message ends with its log's tail."""


# OpenMP workers sleep at once instead of spinning (~0.1-0.3 ms after every parallel region), which
# took the core tritonserver, the shim and the response thread need between steps (~5-10 ms of
# run-queue wait per 32-stream step). The engine thread at nice -19 (engine_loop.py; where the
# process may raise a thread's priority): the plumbing's bursts preempt the step's pool worker
# instead, whose chunks the engine thread takes over. The caller's environment wins.
STUB_ENV_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "TRITON_LLM_ENGINE_NICE": "-19"}


def stub_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with STUB_ENV_DEFAULTS where it does not set them."""
    return {**STUB_ENV_DEFAULTS, **env}


class TritonServer:
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
        self.drain_file = self.workdir / "draining"     # drain() -> the engine (drain_watch.py)
        self.proc = None
        self.starts = 0                       # restart() counts up (fresh shm names, kept logs)
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
    def command(self, install: TritonInstall, repository: pathlib.Path, backends: pathlib.Path,
                attempt: int = 1) -> list[str]:
        """The tritonserver command line for a rendered ``repository`` (``attempt``: fresh shm names
        for a retried start; so is each restart)."""
        return [
            str(install.binary),
            f"--model-repository={repository}",
            f"--backend-directory={backends}",
            # Separate shared-memory names per server, so several servers can run on one machine.
            f"--backend-config=python,shm-region-prefix-name={self._shm_prefix}{self.starts}{attempt}_",
            f"--http-address={self.host}", f"--http-port={self.http_port}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true", f"--log-verbose={self.log_verbose}",
            "--exit-on-error=true", "--strict-readiness=true", f"--exit-timeout-secs={self.exit_timeout}",
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
        remove_drain(self.drain_file)           # a stale deadline from an earlier run would cut at once
        if self.models is None or "engine" in self.models:
            self.engine_options.setdefault("drain_file", str(self.drain_file))
        install = find_tritonserver()
        backends = backend_directory(install, self.workdir)
        repository = generate_repository(self.workdir / "model_repository", self.model_dir,
                                         engine_options=self.engine_options, models=self.models,
                                         instances=self.instances, src=self.repository_src)
        for attempt in (1, 2):
            cmd, env, key_file = hide(self.command(install, repository, backends, attempt), self._admin_key,
                                      self.workdir, stub_env(server_env(install)))
            self.proc = spawn(cmd, self.log_path, cwd=self.workdir, env=env)
            try:
                self._wait_ready()
                if key_file is not None and key_file.exists():     # the loader deletes it before main()
                    raise ServerStartError("tritonserver did not preload the admin-key loader (LD_PRELOAD refused?)")
                return self
            except ServerStartError as exc:
                # 2.51 may abort starting a stub on a loaded host (lock_exception): transient, retry once
                if attempt == 2 or "lock_exception" not in str(exc):
                    self.stop()
                    raise
                terminate_group(self.proc, timeout=self.exit_timeout + 15)
                self.proc = None
                self._say("tritonserver hit boost::interprocess::lock_exception at start; retrying once")
            except BaseException:
                self.stop()
                raise
            finally:
                if key_file is not None:       # deleted by the server at its start; not if it failed first
                    key_file.unlink(missing_ok=True)
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
        try:
            for family in text_string_to_metric_families(text):
                if family.name == "llm_engine_healthy" and family.samples:
                    return all(s.value > 0 for s in family.samples)
        except ValueError:                  # not Prometheus text: nothing to read
            pass
        return None

    def _admin(self, path: str, body: dict | None = None) -> object:
        req = urllib.request.Request(f"http://{self.http_url}{path}", method="POST",
                                     data=json.dumps(body or {}).encode(),
                                     headers={ADMIN_HEADER: self._admin_key, "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read().decode()
        return json.loads(text) if text else None

    def drain(self, timeout: float = 60.0, models: tuple[str, ...] = ("llm", "engine"),
              settle: float = 2.0) -> bool:
        """Refuse new generation requests and wait (up to ``timeout``) for open ones to finish.

        Unloading a model makes Triton refuse new requests for it while requests already in flight
        complete normally (the front ends stay up, so streams keep flowing). The other models
        (preprocessing, postprocessing) are unloaded as soon as nothing can still need them: at
        once when ``llm`` unloads (no ensemble request is open), else once the engine is unloaded
        and ``settle`` seconds passed -- a request the gRPC front end leaked (Triton 2.51 race, see
        client/triton_client.py) would keep ``llm`` loaded forever and must not hold the shutdown.
        Every Python stub takes about a second to stop, so they stop in parallel, and
        tritonserver has nothing left to wait for on SIGTERM. True when drained.
        """
        if not self.alive():
            return True
        try:
            loaded = {m["name"] for m in self._admin("/v2/repository/index", {"ready": True})}
            targets = [m for m in models if m in loaded]
            rest = [m for m in loaded if m not in targets]
            write_drain(self.drain_file, timeout)   # the engine cuts open requests at the deadline
            for m in targets:
                self._admin(f"/v2/repository/models/{m}/unload")
            deadline = time.monotonic() + timeout + 5.0     # the cut, then its finals, then unloads
            engine_gone_at = None
            while self.alive():
                state = self._states()
                if rest and state.get("llm") == "UNAVAILABLE" or (
                        engine_gone_at is not None and time.monotonic() - engine_gone_at >= settle):
                    for m in rest:
                        self._admin(f"/v2/repository/models/{m}/unload")
                    rest = []
                left = sorted(m for m in loaded if state.get(m) != "UNAVAILABLE")
                if not left:
                    return True
                if state.get("engine") == "UNAVAILABLE":
                    engine_gone_at = engine_gone_at or time.monotonic()
                    if not rest and time.monotonic() - engine_gone_at >= 2 * settle:
                        self._say(f"not waiting for {', '.join(left)}: the engine is unloaded, so nothing "
                                  "runs; a client still holds its finished stream open")
                        return True
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.05)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            self._say(f"drain failed: {exc}")
        return not self.alive()

    def _states(self) -> dict[str, str]:
        return {m["name"]: m.get("state", "") for m in self._admin("/v2/repository/index")}

    def unload_generation(self) -> None:
        """Mark ``llm`` and ``engine`` not ready at once (the engine loop died): unload, no wait."""
        for m in ("llm", "engine"):
            try:
                self._admin(f"/v2/repository/models/{m}/unload")
            except (urllib.error.URLError, OSError, ValueError) as exc:
                self._say(f"unloading {m} failed: {exc}")

    def stop(self, grace: float | None = None) -> None:
        """SIGTERM; after ``grace`` seconds (default: the exit timeout + 15) SIGKILL what is left."""
        if self.proc is None:
            return
        self._end(grace)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _end(self, grace: float | None = None) -> None:
        """End the process group (if any is left) and the shared memory its run left behind."""
        if self.proc is not None:
            terminate_group(self.proc, timeout=self.exit_timeout + 15 if grace is None else grace)
            self.proc = None
        self._remove_shm()

    @property
    def _shm_prefix(self) -> str:
        return f"tllm{os.getpid()}_{self.grpc_port}_"

    def _remove_shm(self) -> None:
        """The Python backend's shared-memory regions of this server's runs: a server killed (or
        crashed) leaves them in /dev/shm, 1 MB and more each, until the machine reboots."""
        for region in pathlib.Path("/dev/shm").glob(self._shm_prefix + "*"):
            region.unlink(missing_ok=True)

    def restart(self) -> "TritonServer":
        """Stop what is left of this server and start it again on the same ports and options
        (clients keep their addresses). The last run's log stays beside the new one as
        ``tritonserver.<n>.log``: after a crash, it says why."""
        self._end()
        self.starts += 1
        if self.log_path.exists():
            self.log_path.rename(self.log_path.with_name(f"tritonserver.{self.starts}.log"))
        return self.start()

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
