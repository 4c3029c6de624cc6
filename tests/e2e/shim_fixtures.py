"""The OpenAI shim as a real process in front of the session's tritonserver, plus metric helpers.

    from tests.e2e.shim_fixtures import shim, sdk, async_sdk   # fixtures (module-scoped shim)

``shim`` runs ``python -m client.shim`` on a free loopback port with two API keys (two tenants)
and the served id ``tiny``; it is stopped after the module.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import openai
import pytest

from client.shim.background import free_port
from load.counters import parse_prometheus
from backend.serving.process_group import wait_http_ok

KEY, OTHER_KEY = "sk-e2e-acme", "sk-e2e-globex"
MODEL = "tiny"


@dataclass
class ShimProcess:
    url: str
    proc: subprocess.Popen
    log_path: str
    metrics_url: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def start_shim(triton_server, tmp_dir, *, extra_args=(), grpc_url=None) -> ShimProcess:
    keys = tmp_dir / "keys.txt"
    keys.write_text(f"{KEY}:acme\n{OTHER_KEY}:globex\n")
    port = free_port()
    log_path = tmp_dir / f"shim-{port}.log"
    cmd = [sys.executable, "-m", "client.shim", "--triton-grpc", grpc_url or triton_server.grpc_url,
           "--host", "127.0.0.1", "--port", str(port), "--api-keys", str(keys),
           "--model-dir", str(triton_server.model_dir), "--model-name", MODEL, *extra_args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    if not wait_http_ok(url + "/health", proc, 180):   # imports take long on a loaded 2-core CI host
        stop_shim(proc)
        raise RuntimeError(f"shim did not start:\n{open(log_path, errors='replace').read()[-3000:]}")
    return ShimProcess(url, proc, str(log_path), triton_server.metrics_url)


def stop_shim(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


@pytest.fixture(scope="module")
def shim(triton_server, tmp_path_factory):
    s = start_shim(triton_server, tmp_path_factory.mktemp("shim"))
    yield s
    stop_shim(s.proc)


@pytest.fixture
def sdk(shim):
    return openai.OpenAI(base_url=shim.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture
def async_sdk(shim):
    return openai.AsyncOpenAI(base_url=shim.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


# -- Triton metrics ----------------------------------------------------------------------------
def metric(metrics_url: str, name: str) -> float:
    """Sum of a metric's samples (all label sets) on Triton's metrics endpoint; 0 if absent."""
    return parse_prometheus(httpx.get(metrics_url, timeout=30).text).get(name, 0.0)


def wait_metric(metrics_url: str, name: str, pred, timeout: float = 60.0) -> float:
    """Poll until pred(value) holds; returns the last value (the caller asserts on it)."""
    deadline = time.monotonic() + timeout
    value = metric(metrics_url, name)
    while not pred(value) and time.monotonic() < deadline:
        time.sleep(0.1)
        value = metric(metrics_url, name)
    return value
