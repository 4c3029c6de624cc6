"""bench/attach/sitecustomize.py: a process started with ``<tree>:<tree>/bench/attach`` on PYTHONPATH
imports that tree's ``backend``, not the venv's editable install (how ``load.overhead_ab
NAME@tree=DIR`` serves DIR's code in the Triton stubs, which Python starts the same way)."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _backend_file(pythonpath: list[pathlib.Path], cwd: pathlib.Path) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, pythonpath))}
    out = subprocess.run([sys.executable, "-c", "import backend; print(backend.__file__)"], env=env, cwd=cwd,
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


def test_the_tree_on_pythonpath_wins_over_the_editable_install(tmp_path):
    tree = tmp_path / "tree"
    (tree / "backend").mkdir(parents=True)
    (tree / "backend" / "__init__.py").write_text("")
    shutil.copytree(ROOT / "bench", tree / "bench", ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "backend" / "timing.py").write_text((ROOT / "backend" / "timing.py").read_text())
    got = _backend_file([tree, tree / "bench" / "attach"], cwd=tmp_path)
    assert pathlib.Path(got) == tree / "backend" / "__init__.py"


def test_without_the_attach_folder_the_editable_install_serves(tmp_path):
    # The premise: the venv's editable finder shadows PYTHONPATH (else the attach folder were moot).
    if not any(p.name.startswith("__editable__") for p in pathlib.Path(sys.prefix).glob("lib/python*/site-packages/*")):
        pytest.skip("the project is not installed editable in this interpreter")
    tree = tmp_path / "tree"
    (tree / "backend").mkdir(parents=True)
    (tree / "backend" / "__init__.py").write_text("")
    assert pathlib.Path(_backend_file([tree], cwd=tmp_path)) == ROOT / "backend" / "__init__.py"
