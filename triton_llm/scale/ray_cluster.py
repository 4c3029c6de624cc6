"""The Ray cluster under ``triton-llm serve --replicas``: a local one locked down, or a joined one
that must use Ray's token auth; and the CPUs each deployment asks Ray for.

A local cluster gets a fresh random token (a 0600 file in a 0700 directory, gone at exit) with
``RAY_AUTH_MODE=token``, so every Ray RPC and API call needs it, and all of Ray's ports on
loopback: Ray binds its gRPC servers (GCS, raylets, workers) and agents to 127.0.0.1 only when its
node address is loopback, which on Linux it is when ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (Ray's
single-machine mode; ``ray.init(_node_ip_address="127.0.0.1")`` would be turned back into the
host's address). No dashboard. Ray reads these settings from the environment, and its processes
inherit them, so they are set in this process's environment before Ray starts.

Joining a cluster (``RAY_ADDRESS``) is refused unless this process has Ray's token settings, or
the caller passes ``insecure=True`` (``--ray-address-insecure``).
"""
from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import secrets
import shutil
import tempfile

from common import env

AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
GCS_WAIT = "RAY_gcs_server_port_wait_time_s"
DEFAULT_INGRESS_CPUS = 0.5


class ClusterRefused(RuntimeError):
    """The cluster (or the sizing on it) is refused; the message says what to set."""


def lock_down_local(environ: dict | None = None) -> pathlib.Path:
    """Token auth and loopback-only ports for the local cluster Ray is about to start; returns the
    token's directory (the caller removes it at exit)."""
    d = pathlib.Path(tempfile.mkdtemp(prefix="tllm-ray-auth-"))      # mode 0700
    token = d / "auth_token"
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    values = {"RAY_AUTH_TOKEN": None,            # it would win over the file
              "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
              # Ray's 30 s for its GCS to start ran out on a loaded 2-core host (CI beside a burner)
              GCS_WAIT: env.raw(GCS_WAIT) or "120"}
    if environ is None:
        env.update(values)                      # this process's: Ray and its workers inherit it
    else:
        environ.pop("RAY_AUTH_TOKEN", None)
        environ.update({k: v for k, v in values.items() if v is not None})
    return d


def remove_token(directory: pathlib.Path | None) -> None:
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


def check_join(address: str, insecure: bool, environ: dict | None = None) -> None:
    """Refuse to join ``address`` without Ray's token auth unless ``insecure``."""
    if insecure:
        return
    environ = env.snapshot() if environ is None else environ
    has_token = bool(environ.get("RAY_AUTH_TOKEN") or environ.get("RAY_AUTH_TOKEN_PATH")
                     or (pathlib.Path.home() / ".ray" / "auth_token").is_file())
    if environ.get("RAY_AUTH_MODE", "").lower() == "token" and has_token:
        return
    raise ClusterRefused(
        f"RAY_ADDRESS={address}: refusing to join a Ray cluster without token auth (whoever reaches an "
        "open cluster runs code on it). Set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH=<file holding "
        "the cluster's token> (or RAY_AUTH_TOKEN), or pass --ray-address-insecure to join it anyway.")


def _floor(x: float) -> float:
    return math.floor(x * 100 + 1e-6) / 100


def engine_replicas(cfg) -> int:
    """How many engine replicas may run at once: the primary pool at its largest, the prefill pool,
    the fallback pool."""
    primary = cfg.max_replicas if cfg.autoscale else cfg.replicas
    return primary + cfg.prefill_replicas + (cfg.fallback_replicas if cfg.fallback_model_dir else 0)


def size_cpus(cfg, total_cpus: float, replica_cpus: float | None, ingress_cpus: float | None,
              enforce: bool = True):
    """``cfg`` with the ingress's and each replica's Ray CPUs: given values as given, missing ones
    shared out of ``total_cpus`` (the ingress takes at most a quarter, each replica an equal share
    of the rest). With ``enforce`` (a local cluster, whose CPUs are all there will be) a sum over
    ``total_cpus`` is refused at once: Ray would leave a replica pending forever."""
    n = engine_replicas(cfg)
    ingress = ingress_cpus if ingress_cpus is not None else _floor(min(DEFAULT_INGRESS_CPUS, total_cpus / 4))
    replica = replica_cpus if replica_cpus is not None else _floor((total_cpus - ingress) / n)
    if replica <= 0 or ingress < 0:
        raise ClusterRefused(f"{n} engine replica(s) do not fit in {total_cpus:g} Ray CPUs next to the "
                             f"ingress's {ingress:g}: set --ingress-cpus and --replica-cpus (fractions work)")
    need = ingress + n * replica
    if enforce and need > total_cpus + 1e-6:
        most = _floor((total_cpus - ingress) / n)
        raise ClusterRefused(
            f"{n} engine replica(s) x {replica:g} CPUs + the ingress's {ingress:g} = {need:g} Ray CPUs, but "
            f"this host's Ray has {total_cpus:g}: Ray would never schedule them. Set --replica-cpus to at "
            f"most {most:g} (or leave it unset to share the CPUs out), or lower --ingress-cpus.")
    return dataclasses.replace(cfg, replica_cpus=replica, ingress_cpus=ingress)


def _marked(marker: bytes) -> list[int]:
    """Our user's processes whose environment holds ``marker`` (a local cluster's token path: every
    process of that cluster inherits it, tritonservers and their stubs included), not this one."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    out.append(int(pid))
        except OSError:                             # gone, or not ours
            continue
    return out


def reap_local(token_dir: pathlib.Path, grace: float = 3.0) -> int:
    """SIGTERM, then SIGKILL after ``grace`` seconds, whatever the local cluster left running: a
    replica still starting when Ray went down leaves its tritonserver, whose Python-backend stubs
    outlive it while they load. Returns how many processes were signalled."""
    import signal
    import time

    marker = f"RAY_AUTH_TOKEN_PATH={token_dir / 'auth_token'}".encode()
    pids = _marked(marker)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _marked(marker):
            time.sleep(0.1)
        pids = _marked(marker)
        if not pids:
            break
    return len(pids)
