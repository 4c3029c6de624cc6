"""The launcher fails fast and clearly when a model cannot load, and leaves no processes behind."""
from __future__ import annotations

import os
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
