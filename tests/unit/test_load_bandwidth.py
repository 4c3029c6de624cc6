"""load/bandwidth.py: the read-bandwidth probe runs, and a decode token's weight bytes are the
linears' and the lm_head's (the embedding table counted only where it is the lm_head: tied)."""
from __future__ import annotations

import json

from kernels.cpu import decode_library
from load.bandwidth import decode_weight_elems, gemv_gbps, read_gbps
from tests.conftest import model_dir


def test_probe_reads_the_buffer():
    assert read_gbps(1, gib=1 / 64, reps=1) > 0.1
    gemv = gemv_gbps(1, gib=1 / 64, reps=1)
    assert (gemv is None) == (decode_library() is None) and (gemv is None or gemv > 0.1)


def test_weights_per_decode_token():
    from backend.config import EngineConfig
    from backend.model.runner import ModelRunner

    for preset in ("tiny", "tiny-qwen2"):
        path = model_dir(preset)
        tied = json.loads((path / "config.json").read_text()).get("tie_word_embeddings", False)
        model = ModelRunner(str(path), EngineConfig(block_size=4, num_kv_blocks=8)).model
        linears = sum(m.weight.numel() for m in model.modules() if m.__class__.__name__.endswith("Linear"))
        head = model.lm_head_weight().numel()
        assert (preset == "tiny") == tied                      # both layouts are covered
        assert decode_weight_elems(path) == linears + head     # the lm_head is no Linear module here
