"""Greedy fp32 outputs for requests on three seeded adapters (ranks 8, 16, 64), mixed in one batch
with base-model requests through ``LLM.generate``, equal transformers + PEFT token for token."""
from __future__ import annotations

import pytest
import torch

from backend import LLM, SamplingParams
from tests.unit.lora_helpers import ADAPTERS, make_adapters

MAX_NEW = 10
LENGTHS = [5, 17, 33, 9, 24, 40, 12, 3]
# request i runs on ROUTE[i] (None = the base model): every adapter twice, the base twice
ROUTE = ["ada8", None, "ada16", "ada64", "ada8", "ada64", None, "ada16"]


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 3000, (n,), generator=g).tolist() for n in LENGTHS]


def hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                         min_new_tokens=MAX_NEW, pad_token_id=0)
    return gen[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    return make_adapters(tiny_model, tmp_path_factory.mktemp("loras"))


@pytest.fixture(scope="module")
def reference(tiny_model, adapters):
    """{adapter or None: [greedy tokens per prompt]} from transformers, each adapter by PEFT (unmerged)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = {}
    with torch.inference_mode():
        base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
        out[None] = [hf_greedy(base, p) for p in prompts()]
        for name, path in adapters.items():
            model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                                              path).eval()
            out[name] = [hf_greedy(model, p) for p in prompts()]
    return out


def test_adapters_change_outputs(reference):
    # Otherwise the exactness test below could pass with LoRA ignored.
    for name in ADAPTERS:
        assert reference[name] != reference[None], name


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_mixed_batch_equals_peft(tiny_model, adapters, reference, prefix_caching):
    llm = LLM(tiny_model, max_loras=3, max_lora_rank=64, num_kv_blocks=128, max_num_batched_tokens=64,
              enable_prefix_caching=prefix_caching, lora_modules={k: str(v) for k, v in adapters.items()})
    params = [SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, lora=r) for r in ROUTE]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts(), params)]
    want = [reference[r][i] for i, r in enumerate(ROUTE)]
    assert got == want
    assert llm.engine.stats().kv.num_used_blocks == 0
