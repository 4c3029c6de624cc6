"""bench/lab_venv.py: an interpreter of the overlay imports the given checkout's ``backend`` (not the
venv's editable install) and attaches the first-token trace when LLM_TTFT_TRACE is set."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

from bench.lab_venv import ROOT, lab_venv

PROBE = "import backend, backend.engine.engine_loop as e; print(backend.__file__); print(e.trace is not None)"


def _probe(python: pathlib.Path, **env: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LLM_TTFT_TRACE")} | env
    out = subprocess.run([str(python), "-c", PROBE], env=env, cwd="/", capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.split()


def test_the_overlay_serves_its_tree_and_attaches_the_trace(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "bench", tree / "bench", ignore=shutil.ignore_patterns("__pycache__"))
    for package in ("backend", "common"):          # the engine loop and what it imports
        shutil.copytree(ROOT / package, tree / package, ignore=shutil.ignore_patterns("__pycache__"))
    python = lab_venv(tree, where=tmp_path / "venvs")
    assert _probe(python) == [str(tree / "backend" / "__init__.py"), "False"]
    assert _probe(python, LLM_TTFT_TRACE=str(tmp_path / "trace")) == [str(tree / "backend" / "__init__.py"), "True"]
    # and this checkout's own overlay imports this checkout, with torch & co from the venv
    out = subprocess.run([str(lab_venv(ROOT, where=tmp_path / "venvs")), "-c", "import backend, numpy; print(backend.__file__)"],
                         cwd="/", capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == str(ROOT / "backend" / "__init__.py")
