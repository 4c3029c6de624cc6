"""The environment tritonserver gets makes its Python stubs load *this* interpreter's libpython,
deterministically: with LD_LIBRARY_PATH missing it the wheel's stub resolves Debian's system
libpython, and a stub importing this interpreter's stdlib then fails (``_ssl``: undefined symbol)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import sysconfig

import pytest

from backend.serving import install as inst

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _libdir() -> str:
    return sysconfig.get_config_var("LIBDIR") or str(pathlib.Path(sys.base_prefix) / "lib")


def test_server_env_from_many_threads_at_once_always_names_libpython_dir():
    # serve --disagg starts two servers from two threads in a fresh process; Python 3.11's sysconfig
    # fills its config vars lazily without a lock, so the race is replayed from a cold sysconfig
    script = (
        "import sysconfig, threading\n"
        "from backend.serving import install\n"
        "sysconfig._CONFIG_VARS = None\n"
        "fake = install.TritonInstall(binary=None, backends=None, wheel_root=None)\n"
        "out, go = [], threading.Barrier(16)\n"
        "def run():\n"
        "    go.wait(); out.append(install.server_env(fake, {})['LD_LIBRARY_PATH'])\n"
        "ts = [threading.Thread(target=run) for _ in range(16)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "print('\\n'.join(out))\n")
    for _ in range(5):
        res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                             timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert res.returncode == 0, res.stderr
        paths = res.stdout.split()
        assert len(paths) == 16
        assert all(_libdir() in p.split(os.pathsep) for p in paths), paths


def test_the_wheels_stub_resolves_this_interpreters_libpython():
    wheel = inst._wheel_root()
    if wheel is None:
        pytest.skip("nvidia-pytriton is not installed")
    stub = wheel / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}" / inst.STUB
    if not stub.exists():
        pytest.skip(f"the wheel has no stub for Python {sys.version_info[:2]}")
    base = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env = inst.server_env(inst.TritonInstall(binary=None, backends=None, wheel_root=wheel), base)
    res = subprocess.run(["ldd", str(stub)], capture_output=True, text=True, env=env, timeout=30)
    line = next(ln for ln in res.stdout.splitlines() if "libpython" in ln)
    resolved = pathlib.Path(line.split("=>")[1].split("(")[0].strip()).resolve()
    assert resolved.parent == pathlib.Path(_libdir()).resolve(), line
