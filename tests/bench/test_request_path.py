"""bench/request_path.py: a process with LLM_PATH_TRACE notes the files of the functions it calls
while ``<dir>/on`` exists, and only ours are reported."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from bench.request_path import ROOT, ours

CHILD = """
import pathlib, sys, time
from bench import request_path
request_path.attach_from_env()
d = pathlib.Path(sys.argv[1])
import backend.sampling_params as sp, backend.pooling_params
sp.SamplingParams()                         # before "on": not noted
(d / "on").touch(); time.sleep(0.3)
sp.SamplingParams(temperature=0.5)          # noted
(d / "on").unlink(); time.sleep(0.3)
"""


def test_a_process_notes_what_it_runs_while_on(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"LLM_PATH_TRACE": str(tmp_path)}
    subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], cwd=ROOT, env=env, check=True, timeout=120)
    traces = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert len(traces) == 1
    files = ours(traces)
    assert "backend/sampling_params.py" in files and files["backend/sampling_params.py"] == {"MainThread"}
    assert "backend/pooling_params.py" not in files           # imported, never called


def test_ours_maps_rendered_adapters_and_drops_the_rest():
    traces = [{f"{ROOT}/backend/engine/sequence.py": ["engine-loop"],
               "/tmp/triton-llm-x/model_repository/engine/1/model.py": ["MainThread"],
               f"{ROOT}/.venv/lib/python3.11/site-packages/torch/nn/modules/module.py": ["engine-loop"],
               "/usr/lib/python3.11/json/__init__.py": ["MainThread"]}]
    assert ours(traces) == {"backend/engine/sequence.py": {"engine-loop"},
                            "model_repository/engine/1/model.py": {"MainThread"}}
