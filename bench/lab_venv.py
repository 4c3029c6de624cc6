"""A thin venv over this one that serves a given checkout and attaches the lab's hooks, in every
Python process of a stack started with its interpreter, the Triton stubs included.

The stubs' embedded interpreter ignores PYTHONPATH; it takes ``sys.prefix`` from the ``python3``
first on PATH (backend/serving/install.py) and runs that venv's ``.pth`` files. So the overlay's
one ``.pth`` puts the checkout first on ``sys.path``, then adds this venv's site-packages (its
packages and the project's editable finder, which the checkout now shadows), then attaches the
lab's tracers when their environment asks (bench/ttft_trace.py: the engine loop's hook;
bench/request_path.py: the files a request runs).

    python -m bench.lab_venv [TREE]     # prints the overlay's python; start the stack with it
"""
from __future__ import annotations

import hashlib
import pathlib
import subprocess
import sys
import sysconfig

ROOT = pathlib.Path(__file__).resolve().parents[1]


def lab_venv(tree: str | pathlib.Path = ROOT, where: pathlib.Path = ROOT / "build" / "lab-venvs") -> pathlib.Path:
    """The overlay's python for ``tree`` (made once per tree and venv, refreshed each call)."""
    tree = pathlib.Path(tree).resolve()
    base_site = pathlib.Path(sysconfig.get_paths()["purelib"])
    d = where / hashlib.sha1(f"{tree}\0{sys.prefix}".encode()).hexdigest()[:12]
    python = d / "bin" / "python3"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(d)], check=True)
    overlay_site = pathlib.Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                               check=True, capture_output=True, text=True).stdout.strip())
    (overlay_site / "00-lab.pth").write_text(
        f"{tree}\n"
        f"import site; site.addsitedir({str(base_site)!r})\n"
        "import bench.ttft_trace as t, bench.request_path as p; t.attach_from_env(); p.attach_from_env()\n")
    return python


if __name__ == "__main__":
    print(lab_venv(sys.argv[1] if len(sys.argv) > 1 else ROOT))

