"""TritonServer.start retries once when tritonserver dies of its start-up race (boost
interprocess lock_exception on a loaded host), and only then; no real server here (the e2e
fixtures start real ones)."""
from __future__ import annotations

import pathlib
import types

import pytest

from backend.serving import tritonserver as ts
from backend.serving.argv_secret import MARK


class FakeProc:
    def poll(self):
        return None


@pytest.fixture()
def server(monkeypatch, tmp_path):
    spawned, killed = [], []
    install = types.SimpleNamespace(binary="tritonserver", wheel_root=None)
    monkeypatch.setattr(ts, "find_tritonserver", lambda: install)
    monkeypatch.setattr(ts, "backend_directory", lambda install, workdir: tmp_path / "backends")
    monkeypatch.setattr(ts, "generate_repository", lambda path, *a, **k: path)
    monkeypatch.setattr(ts, "server_env", lambda install: {})

    def spawn(cmd, log, **kwargs):
        for arg in cmd:           # what the preloaded loader does before main(): read, then delete
            if MARK in arg:
                pathlib.Path(arg.split(MARK, 1)[1]).unlink(missing_ok=True)
        spawned.append(cmd)
        return FakeProc()
    monkeypatch.setattr(ts, "spawn", spawn)
    monkeypatch.setattr(ts, "terminate_group", lambda proc, timeout: killed.append(proc))
    s = ts.TritonServer(tmp_path / "model", workdir=tmp_path / "w", quiet=True)
    return s, spawned, killed


def _fail_first(server, monkeypatch, message):
    calls = []

    def wait_ready():
        calls.append(1)
        if len(calls) == 1:
            raise ts.ServerStartError(message)
    monkeypatch.setattr(server, "_wait_ready", wait_ready)


def test_a_lock_exception_at_start_is_retried_once_with_fresh_shm_names(server, monkeypatch):
    s, spawned, killed = server
    _fail_first(s, monkeypatch, "tritonserver exited with code 134\nboost::interprocess::lock_exception")
    assert s.start() is s and s.proc is not None
    assert len(spawned) == 2 and len(killed) == 1
    prefixes = [next(a for a in cmd if "shm-region-prefix-name" in a) for cmd in spawned]
    assert prefixes[0] != prefixes[1]


def test_other_start_failures_are_not_retried(server, monkeypatch):
    s, spawned, killed = server
    _fail_first(s, monkeypatch, "tritonserver exited with code 1: a model failed to load")
    with pytest.raises(ts.ServerStartError, match="failed to load"):
        s.start()
    assert len(spawned) == 1 and s.proc is None


def test_a_second_lock_exception_is_raised(server, monkeypatch):
    s, spawned, killed = server
    monkeypatch.setattr(s, "_wait_ready", lambda: (_ for _ in ()).throw(ts.ServerStartError("lock_exception")))
    with pytest.raises(ts.ServerStartError):
        s.start()
    assert len(spawned) == 2 and s.proc is None
