"""The environment tritonserver (and so the engine stub) starts with: OpenMP waits passively unless
the caller chose otherwise (backend/serving/tritonserver.py STUB_ENV_DEFAULTS)."""
from backend.serving.tritonserver import STUB_ENV_DEFAULTS, stub_env


def test_openmp_threads_wait_passively_by_default():
    env = stub_env({"PATH": "/usr/bin"})
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert env["PATH"] == "/usr/bin"


def test_the_callers_setting_wins():
    assert stub_env({"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"
    assert set(STUB_ENV_DEFAULTS) == {"OMP_WAIT_POLICY"}
