"""One Ray Serve application for an e2e test module: a local Ray cluster, Serve's HTTP proxy on a
free loopback port, the app built from a ScaleConfig, torn down with its replicas' workdirs."""
from __future__ import annotations

import contextlib
import pathlib
import shutil
import tempfile
import time

import pytest

from backend.serving.process_group import free_port, scoped_environ
from triton_llm.scale.ray_cluster import GCS_WAIT

ROOT = pathlib.Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def serve_app(cfg, name: str, *, num_cpus: int = 4, start_timeout: float = 300, env: dict | None = None):
    """Yields the app's base URL once Serve reports it RUNNING; ``env``: more environment for the
    cluster's workers (the replicas and the tritonservers they start)."""
    import ray
    from ray import serve

    from triton_llm.scale.app import build_app

    started = time.time() - 1
    # worker_niceness 0: Ray starts its workers 15 nice levels below the driver by default, which
    # put the replicas and their tritonservers at a nice -n 19 CPU burner's level (CI runs one).
    # GCS_WAIT: Ray's 30 s for its GCS to start ran out in CI beside a burner (serve --replicas: 120 s)
    with scoped_environ({GCS_WAIT: "180"}):
        ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level="ERROR",
                 runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), **(env or {})}},
                 _system_config={"worker_niceness": 0})
    # The proxy's port is picked once Ray's own processes have bound theirs: picked before, one of
    # them took it in CI ("Failed to bind to address" and the whole module errored).
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(cfg), name=name, route_prefix="/", blocking=False)
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline:
            st = serve.status().applications.get(name)
            if st is not None and st.status == "RUNNING":
                break
            time.sleep(1)
        else:
            pytest.fail(f"the Ray Serve app did not start: {serve.status()}")
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()                     # replicas' __del__ stop their tritonservers
        finally:
            ray.shutdown()
            # Ray does not always run a replica's __del__ (killed, replaced): its server dies with
            # it, its workdir stays; remove this run's.
            for d in pathlib.Path(tempfile.gettempdir()).glob("tllm-replica-*"):
                if d.stat().st_mtime >= started:
                    shutil.rmtree(d, ignore_errors=True)


def replica_tritonservers() -> list[dict]:
    """The live tritonservers of Ray replicas (triton_llm/scale/replica.py names a replica's workdir
    ``tllm-replica-<id>-...``): [{"pid", "repo", "metrics_port", "grpc_port"}]."""
    import os

    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if not cmd or not cmd[0].endswith("tritonserver"):
            continue
        repo = next((c.split("=", 1)[1] for c in cmd if c.startswith("--model-repository=")), "")
        if "tllm-replica-" not in repo:
            continue
        port = next(int(c.split("=")[1]) for c in cmd if c.startswith("--metrics-port="))
        grpc = next(int(c.split("=")[1]) for c in cmd if c.startswith("--grpc-port="))
        out.append({"pid": int(pid), "repo": repo, "metrics_port": port, "grpc_port": grpc})
    return out


def received_unread(port: int) -> int:
    """Bytes that arrived on the established TCP connections to local ``port`` and that their
    owner has not read yet (the kernel's receive queues, /proc/net/tcp and tcp6): what a client
    sent to a frozen (SIGSTOP) server since it stopped reading."""
    total = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = pathlib.Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "01":   # ESTABLISHED
                total += int(f[4].split(":")[1], 16)                         # rx_queue
    return total
