"""Float adapters on a weight-only quantized base (int8 / int4), in the fused C step like base rows
(the quant GEMMs, then kernels/csrc/lora_cpu.c on the adapter rows), and neither changes the other's
rows: base requests in a mixed batch answer as in a base-only batch, adapter requests as when they
run alone."""
from __future__ import annotations

import pytest
import torch

from backend import LLM, SamplingParams
from backend.lora.fused import rows_done
from tests.unit.lora_helpers import make_adapter

G = {"temperature": 0, "max_tokens": 12, "min_tokens": 12}
ROUTE = ["a", None, "a", None]


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory):
    return str(make_adapter(tiny_model, tmp_path_factory.mktemp("q") / "a", 8, 16, ["q_proj", "down_proj"], 61))


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_adapters_on_a_quantized_base(tiny_model, adapter, quantization):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 3000, (n,), generator=g).tolist() for n in (9, 21, 14, 30)]
    llm = LLM(tiny_model, num_kv_blocks=64, quantization=quantization, max_loras=1, lora_modules={"a": adapter})
    base = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(**G))]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(lora="a", **G))]
    before = rows_done()
    mixed = [o.outputs[0].token_ids for o in llm.generate(prompts, [SamplingParams(lora=r, **G) for r in ROUTE])]
    if llm.engine.runner.fused is not None:      # the quant C library built: adapter rows ran in C
        assert rows_done() > before
    assert mixed == [alone[i] if r else base[i] for i, r in enumerate(ROUTE)]
    assert all(alone[i] != base[i] for i in range(len(prompts)))
