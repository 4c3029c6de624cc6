"""KV computed under one LoRA adapter is never reused by another adapter or the base model; the
same adapter reuses it (the adapter's identity is in the block hash chain, like the tenant salt)."""
from __future__ import annotations

import pytest
import torch

from backend import LLM, SamplingParams
from backend.kv_cache.block_pool import ROOT_HASH, extra_key, hash_block
from tests.unit.lora_helpers import make_adapter

PROMPT = torch.randint(3, 3000, (50,), generator=torch.Generator().manual_seed(11)).tolist()


@pytest.fixture(scope="module")
def two(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return {"a": str(make_adapter(tiny_model, root / "a", 8, 16, ["q_proj", "k_proj", "v_proj"], 21)),
            "b": str(make_adapter(tiny_model, root / "b", 8, 16, ["q_proj", "k_proj", "v_proj"], 22))}


def run(llm: LLM, lora: str | None) -> tuple[list[int], int]:
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, min_tokens=4, lora=lora))[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def test_extra_key():
    assert extra_key("tenant:x", None) == "tenant:x" and extra_key(None, None) is None
    keys = {extra_key(s, u) for s in (None, "tenant:x") for u in (None, "a@1", "b@1")}
    assert len(keys) == 6
    assert len({hash_block(ROOT_HASH, [1, 2], k) for k in keys}) == 6


def test_no_reuse_across_adapters(tiny_model, two):
    llm = LLM(tiny_model, max_loras=2, num_kv_blocks=64, block_size=16, lora_modules=two)
    fresh = LLM(tiny_model, max_loras=2, num_kv_blocks=64, block_size=16, lora_modules=two,
                enable_prefix_caching=False)
    toks_a, cached = run(llm, "a")
    assert cached == 0
    toks_b, cached = run(llm, "b")                # same prompt, other adapter: nothing reused
    assert cached == 0 and toks_b == run(fresh, "b")[0] and toks_b != toks_a
    toks_base, cached = run(llm, None)            # nor by the base model
    assert cached == 0 and toks_base == run(fresh, None)[0]
    again, cached = run(llm, "a")                 # the same adapter reuses its full blocks
    assert cached == 48 and again == toks_a
    assert run(llm, "b")[1] == 48
