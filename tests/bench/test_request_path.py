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
import backend.engine.admission as sp, backend.pooling_params
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
    assert "backend/engine/admission.py" in files and files["backend/engine/admission.py"] == {"MainThread"}
    assert "backend/pooling_params.py" not in files           # imported, never called


def test_ours_maps_rendered_adapters_and_drops_the_rest():
    traces = [{f"{ROOT}/backend/engine/sequence.py": ["engine-loop"],
               "/tmp/triton-llm-x/model_repository/engine/1/model.py": ["MainThread"],
               f"{ROOT}/.venv/lib/python3.11/site-packages/torch/nn/modules/module.py": ["engine-loop"],
               "/usr/lib/python3.11/json/__init__.py": ["MainThread"]}]
    assert ours(traces) == {"backend/engine/sequence.py": {"engine-loop"},
                            "model_repository/engine/1/model.py": {"MainThread"}}


def documented_path() -> set[str]:
    """The files docs/architecture.md lists under "The files one streamed chat completion touches"
    (a bare name is in the folder of the last path before it)."""
    import re

    text = (ROOT / "docs/architecture.md").read_text()
    section = text.split("### The files one streamed chat completion touches", 1)[1].split("\n#", 1)[0]
    bullets = section[section.index("\n- **"):section.index("\n\nStructured-output code")]
    files, folder = set(), ""
    for name in re.findall(r"`([\w./]+\.(?:py|c|pbtxt))`", bullets):
        if "/" in name:
            folder = name.rpartition("/")[0]
        files.add(name if "/" in name else f"{folder}/{name}")
    return files


def test_the_documented_path_is_the_one_a_real_stack_runs():
    """A real stack (tritonserver + shim) serves one streamed chat completion under the tracer: the
    Python files it ran code from are exactly the documented ones, less the two the tracer cannot
    see (the ensemble's config.pbtxt, the C step), and the doc's count is right."""
    from bench.request_path import run

    documented = documented_path()
    by_hand = {"model_repository/llm/config.pbtxt", "kernels/csrc/decode_cpu.c"}
    assert by_hand <= documented
    assert set(run()) == documented - by_hand
    assert f"decode step and back ({len(documented)})" in (ROOT / "docs/architecture.md").read_text()
    assert len(documented) <= 30
