"""The launcher fails fast and clearly when a model cannot load, and leaves no processes behind."""
from __future__ import annotations

import os
import pathlib
import shutil

import pytest

from backend.serving.launcher import ServerStartError, TritonServer
from backend.serving.repository import TEMPLATES
from tests.conftest import model_dir

pytestmark = pytest.mark.e2e


def test_missing_checkpoint_fails_before_starting_with_reason(tmp_path):
    server = TritonServer(tmp_path / "no-such-model", models=["preprocessing"], quiet=True)
    with pytest.raises(ValueError, match="no-such-model has no config.json: not a Hugging Face checkpoint"):
        server.start()                      # rendering the repository reads the checkpoint's config
    assert server.proc is None and not server.alive()


def test_broken_config_fails_fast_with_reason(tmp_path):
    src = tmp_path / "templates"
    shutil.copytree(TEMPLATES, src)
    cfg = src / "preprocessing" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace("TYPE_INT32", "TYPE_NOT_A_TYPE"))
    server = TritonServer(model_dir("tiny"), repository_src=src, models=["preprocessing"], quiet=True)
    with pytest.raises(ServerStartError) as info:
        server.start()
    # fast: the server's exit was seen, not the start-up timeout run out (no wall-clock bound)
    assert "before becoming ready" in str(info.value) and "not ready after" not in str(info.value)
    assert "TYPE_NOT_A_TYPE" in str(info.value)


def test_stop_leaves_no_processes():
    server = TritonServer(model_dir("tiny"), models=["preprocessing"], quiet=True).start()
    pgid = server.proc.pid
    server.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


def test_unknown_engine_option_rejected_before_start():
    with pytest.raises(ValueError, match="unknown engine option 'blok_size'"):
        TritonServer(model_dir("tiny"), engine_options=["blok_size=16"])


def test_a_killed_server_restarts_on_its_ports_keeping_its_log_not_its_shared_memory(tmp_path):
    import signal
    import urllib.request

    server = TritonServer(model_dir("tiny"), models=["preprocessing"], quiet=True, workdir=tmp_path).start()
    shm, prefix = pathlib.Path("/dev/shm"), f"tllm{os.getpid()}_{server.grpc_port}_"
    try:
        ports, first_pgid = (server.http_port, server.grpc_port, server.metrics_port), server.proc.pid
        os.killpg(first_pgid, signal.SIGKILL)
        server.proc.wait()
        assert not server.alive()
        first_log = server.log_path.read_text()
        assert list(shm.glob(prefix + "01_*"))     # the killed server's Python-backend regions
        server.restart()
        assert not list(shm.glob(prefix + "01_*")) and list(shm.glob(prefix + "11_*"))
        assert server.alive() and server.proc.pid != first_pgid
        assert (server.http_port, server.grpc_port, server.metrics_port) == ports
        with urllib.request.urlopen(f"http://{server.http_url}/v2/models/preprocessing/ready", timeout=10) as r:
            assert r.status == 200
        assert (tmp_path / "tritonserver.1.log").read_text() == first_log and "Started HTTPService" in first_log
        with pytest.raises(ProcessLookupError):
            os.killpg(first_pgid, 0)                # the dead server's group is gone
    finally:
        server.stop()
    assert not list(shm.glob(prefix + "*"))     # nor are the restarted one's after stop()


def test_a_server_that_did_not_preload_the_admin_key_loader_is_stopped(tmp_path, monkeypatch):
    """Fail closed (issue 30): without the loader tritonserver would take the secret file's
    reference, readable on its command line, for its admin key."""
    from backend.serving import tritonserver

    real = tritonserver.hide

    def preload_refused(args, secret, folder, env):
        hidden, env, path = real(args, secret, folder, env)
        return hidden, {k: v for k, v in env.items() if k != "LD_PRELOAD"}, path

    monkeypatch.setattr(tritonserver, "hide", preload_refused)
    server = TritonServer(model_dir("tiny"), models=["preprocessing"], quiet=True, workdir=tmp_path)
    with pytest.raises(ServerStartError, match="did not preload the admin-key loader"):
        server.start()
    assert server.proc is None and not list(tmp_path.glob(".secret-*"))    # stopped; the file gone
