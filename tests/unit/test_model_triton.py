"""The Triton attention backend gives the torch backend's logits (Triton interpreter on CPU).

``triton.jit`` picks the interpreter when ``kernels`` is imported, so TRITON_INTERPRET=1 must be
set before that. A pytest process that imported ``kernels`` without it (this file run alone, say)
cannot interpret them any more: there the test runs itself again, the same node id, in a fresh
pytest with TRITON_INTERPRET=1, and passes or fails with it. Where the kernels are already
interpreted (the whole suite: tests/kernels/conftest.py sets it at collection) it runs in-process.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from backend.config import EngineConfig
from backend.model.attention import TritonAttention
from backend.model.runner import SeqChunk, build_batch
from backend.model.runner import ModelRunner
from tests.conftest import ROOT, model_dir

CHILD = "LLM_TEST_TRITON_CHILD"        # set in the re-run, so it never re-runs itself again


def run_interpreted_or_rerun(nodeid: str) -> bool:
    """True when this process can run the kernels interpreted; else re-run ``nodeid`` in a
    fresh pytest with TRITON_INTERPRET=1, assert it passed, and return False."""
    import kernels

    if kernels.interpreted():
        return True
    if os.environ.get(CHILD):
        pytest.fail(f"TRITON_INTERPRET=1 but the kernels are not interpreted (triton installed: "
                    f"{kernels.device.HAVE_TRITON})")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), **{CHILD: "1"})
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", nodeid],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return False


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2"])
def test_triton_backend_matches_torch_backend(preset, request):
    if not run_interpreted_or_rerun(request.node.nodeid):
        return
    path = str(model_dir(preset))
    runners = {b: ModelRunner(path, EngineConfig(block_size=4, num_kv_blocks=32, attention_backend=b))
               for b in ("torch", "triton")}
    assert isinstance(runners["triton"].attention, TritonAttention)
    rng = random.Random(0)
    a, b, c = ([rng.randrange(runners["torch"].info.vocab_size) for _ in range(n)] for n in (13, 9, 6))
    ta, tb, tc = [5, 17, 2, 30], [11, 8, 23], [4, 27]          # block tables, block_size 4
    # (chunks, logits rows): all_logits=True gives a row per new token, else one per chunk
    steps = [
        # prefill A and B whole, C's first chunk
        ([SeqChunk(a[:12], 0, ta, all_logits=True), SeqChunk(b[:8], 0, tb, all_logits=True),
          SeqChunk(c[:3], 0, tc, all_logits=True)], 12 + 8 + 3),
        # mixed: A and B decode, C's second chunk after its cached prefix
        ([SeqChunk(a[12:], 12, ta), SeqChunk(c[3:], 3, tc, all_logits=True), SeqChunk(b[8:], 8, tb)], 1 + 3 + 1),
    ]
    for chunks, rows in steps:
        batch = build_batch(chunks, 4)
        torch_logits, triton_logits = (r.execute(batch) for r in (runners["torch"], runners["triton"]))
        assert torch_logits.shape == triton_logits.shape == (rows, runners["torch"].info.vocab_size)
        worst = float((torch_logits - triton_logits).abs().max())
        assert worst < 1e-4, (preset, worst)
