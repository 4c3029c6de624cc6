"""The Triton attention backend gives the torch backend's logits (Triton interpreter on CPU).

TRITON_INTERPRET must be set before ``kernels`` is imported, and this pytest process may already
have imported it without, so the comparison runs in a fresh interpreter.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT, model_dir

SCRIPT = textwrap.dedent("""
    import json, random, sys
    import torch
    from backend.config import EngineArgs
    from backend.model.batch_builder import SeqChunk, build_batch
    from backend.model.runner import ModelRunner

    path = sys.argv[1]
    runners = {b: ModelRunner(path, EngineArgs(block_size=4, num_kv_blocks=32, attention_backend=b))
               for b in ("torch", "triton")}
    assert type(runners["triton"].attention).__name__ == "TritonAttention"
    rng = random.Random(0)
    a, b, c = ([rng.randrange(runners["torch"].info.vocab_size) for _ in range(n)] for n in (13, 9, 6))
    ta, tb, tc = [5, 17, 2, 30], [11, 8, 23], [4, 27]
    steps = [
        # prefill A and B whole, C's first chunk
        [SeqChunk(a[:12], 0, ta, True), SeqChunk(b[:8], 0, tb, True), SeqChunk(c[:3], 0, tc, True)],
        # mixed: A and B decode, C's second chunk after its cached prefix
        [SeqChunk(a[12:], 12, ta), SeqChunk(c[3:], 3, tc, True), SeqChunk(b[8:], 8, tb)],
    ]
    worst = 0.0
    for chunks in steps:
        batch = build_batch(chunks, 4)
        out = {k: r.execute(batch) for k, r in runners.items()}
        worst = max(worst, float((out["torch"] - out["triton"]).abs().max()))
    print(json.dumps({"max_abs_diff": worst}))
""")


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2"])
def test_triton_backend_matches_torch_backend(preset):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir(preset))], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["max_abs_diff"] < 1e-4, result
