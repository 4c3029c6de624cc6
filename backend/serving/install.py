"""Where tritonserver and its Python backend live, and the environment they need.

Two installations are supported:

* a Triton container (NGC ``tritonserver:<yy.mm>-py3``): ``/opt/tritonserver/bin/tritonserver`` with
  ``/opt/tritonserver/backends/python`` next to it, used as is;
* the ``nvidia-pytriton`` wheel (CPU machines without Docker): a real tritonserver plus one
  ``triton_python_backend_stub`` per Python minor version. Triton wants the stub inside the python
  backend's directory, so a backend directory is assembled in the work dir from the wheel's
  ``backends/python/`` and the stub matching this interpreter.

The stub takes ``sys.prefix`` from the ``python3`` first on ``PATH`` and links ``libpython``, hence the
``PATH`` and ``LD_LIBRARY_PATH`` built by :func:`server_env`.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import sys
import sysconfig
from dataclasses import dataclass

from common import env

CONTAINER_TRITONSERVER = pathlib.Path("/opt/tritonserver/bin/tritonserver")
STUB = "triton_python_backend_stub"
# This interpreter's libpython directory, read once at import: Python 3.11's sysconfig fills its
# config vars lazily without a lock, so two threads starting servers at once (serve --disagg) could
# read LIBDIR as None, and that server's stubs then loaded the system libpython (issue 21's bug).
LIBDIR = sysconfig.get_config_var("LIBDIR") or str(pathlib.Path(sys.base_prefix) / "lib")


@dataclass
class TritonInstall:
    binary: pathlib.Path
    backends: pathlib.Path | None            # a ready backend directory, or None = assemble one
    wheel_root: pathlib.Path | None          # pytriton/tritonserver when the binary is the wheel's


def _wheel_root() -> pathlib.Path | None:
    try:
        import pytriton
    except ImportError:
        return None
    root = pathlib.Path(pytriton.__file__).resolve().parent / "tritonserver"
    return root if (root / "bin" / "tritonserver").exists() else None


def find_tritonserver() -> TritonInstall:
    """``$TRITONSERVER``, else the container's ``/opt/tritonserver``, else the nvidia-pytriton wheel's."""
    wheel = _wheel_root()
    candidates = []
    if env.raw("TRITONSERVER"):
        candidates.append(pathlib.Path(env.raw("TRITONSERVER")))
    candidates.append(CONTAINER_TRITONSERVER)
    if wheel is not None:
        candidates.append(wheel / "bin" / "tritonserver")
    for binary in candidates:
        if not binary.is_file():
            continue
        binary = binary.resolve()
        backends = binary.parent.parent / "backends"
        ready = (backends / "python" / STUB).exists()
        is_wheel = wheel is not None and binary == (wheel / "bin" / "tritonserver").resolve()
        return TritonInstall(binary, backends if ready else None, wheel if is_wheel else None)
    raise FileNotFoundError(
        "tritonserver not found: set $TRITONSERVER, run inside the NGC tritonserver container, "
        "or `pip install nvidia-pytriton` (it ships tritonserver with the Python backend)")


def backend_directory(install: TritonInstall, workdir: pathlib.Path) -> pathlib.Path:
    """A ``--backend-directory`` whose ``python/`` holds the backend and this Python's stub."""
    if install.backends is not None:
        return install.backends
    wheel = install.wheel_root or _wheel_root()
    if wheel is None:
        raise FileNotFoundError(f"{install.binary} has no python backend and nvidia-pytriton is not installed")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = wheel / "python_backend_stubs" / version / STUB
    if not stub.exists():
        have = sorted(p.name for p in (wheel / "python_backend_stubs").iterdir())
        raise FileNotFoundError(f"no Python backend stub for Python {version} (the wheel has {have})")
    out = workdir / "backends"
    python_dir = out / "python"
    if python_dir.exists():
        shutil.rmtree(python_dir)
    shutil.copytree(wheel / "backends" / "python", python_dir,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(stub, python_dir / STUB)
    return out


def server_env(install: TritonInstall, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver: shared libraries found, this venv's python3 first on PATH."""
    out = env.snapshot() if base is None else dict(base)
    libs: list[str] = []
    if install.wheel_root is not None:
        site = install.wheel_root.parent.parent             # .../site-packages
        for d in (site / "nvidia_pytriton.libs", install.wheel_root / "external_libs"):
            if d.is_dir():
                libs.append(str(d))
    libs.append(LIBDIR)
    if out.get("LD_LIBRARY_PATH"):
        libs.append(out["LD_LIBRARY_PATH"])
    out["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
    venv_bin = str(pathlib.Path(sys.executable).parent)
    out["PATH"] = os.pathsep.join([venv_bin, out.get("PATH", "")])
    if sys.prefix != sys.base_prefix:
        out["VIRTUAL_ENV"] = sys.prefix
    return out
