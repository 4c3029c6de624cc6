"""The environment tritonserver (and so the engine stub) starts with: OpenMP waits passively and the
engine thread asks for a high priority, unless the caller chose otherwise
(backend/serving/tritonserver.py STUB_ENV_DEFAULTS)."""
from backend.serving.tritonserver import STUB_ENV_DEFAULTS, stub_env


def test_openmp_threads_wait_passively_and_the_engine_thread_asks_for_priority_by_default():
    env = stub_env({"PATH": "/usr/bin"})
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert int(env["TRITON_LLM_ENGINE_NICE"]) < 0
    assert env["PATH"] == "/usr/bin"


def test_the_callers_setting_wins():
    assert set(STUB_ENV_DEFAULTS) == {"OMP_WAIT_POLICY", "TRITON_LLM_ENGINE_NICE"}
    env = stub_env({"OMP_WAIT_POLICY": "ACTIVE", "TRITON_LLM_ENGINE_NICE": "0"})
    assert env["OMP_WAIT_POLICY"] == "ACTIVE" and env["TRITON_LLM_ENGINE_NICE"] == "0"


def test_scoped_environ_sets_unsets_and_restores_even_on_error(monkeypatch):
    import os

    import pytest

    from backend.serving.process_group import scoped_environ

    monkeypatch.setenv("TLLM_A", "old")
    monkeypatch.delenv("TLLM_B", raising=False)
    with pytest.raises(RuntimeError):
        with scoped_environ({"TLLM_A": None, "TLLM_B": "new"}):
            assert "TLLM_A" not in os.environ and os.environ["TLLM_B"] == "new"
            raise RuntimeError("a server failed to start")
    assert os.environ["TLLM_A"] == "old" and "TLLM_B" not in os.environ
