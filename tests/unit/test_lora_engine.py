"""Adapters in the engine: unknown names are clear errors, and unloading an adapter while a stream
runs on it changes nothing for that stream (it holds its weights); a new request on it is refused."""
from __future__ import annotations

import pytest
import torch

from backend import LLM, SamplingParams
from backend.errors import EngineError, ErrorKind
from tests.unit.lora_helpers import make_adapter

PROMPT = torch.randint(3, 3000, (20,), generator=torch.Generator().manual_seed(5)).tolist()
GREEDY = {"temperature": 0, "max_tokens": 8, "min_tokens": 8}


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory):
    return str(make_adapter(tiny_model, tmp_path_factory.mktemp("l") / "a", 16, 32, ["o_proj", "up_proj"], 9))


def test_unknown_and_off(tiny_model, adapter):
    llm = LLM(tiny_model, max_loras=1, num_kv_blocks=32, lora_modules={"a": adapter})
    with pytest.raises(EngineError) as err:
        llm.engine.add_request("r", PROMPT, SamplingParams(lora="nope", **GREEDY))
    assert err.value.kind is ErrorKind.INVALID_REQUEST and err.value.param == "lora"
    assert "unknown LoRA adapter 'nope'" in err.value.message
    assert not llm.engine.has_unfinished()
    off = LLM(tiny_model, num_kv_blocks=32)
    with pytest.raises(EngineError, match="LoRA is off"):
        off.engine.add_request("r", PROMPT, SamplingParams(lora="a", **GREEDY))


def test_unload_while_streaming(tiny_model, adapter):
    llm = LLM(tiny_model, max_loras=1, num_kv_blocks=32, lora_modules={"a": adapter})
    want = llm.generate([PROMPT], SamplingParams(lora="a", **GREEDY))[0].outputs[0].token_ids
    eng = llm.engine
    eng.add_request("s", PROMPT, SamplingParams(lora="a", **GREEDY), stream=True)
    got = []
    for d in eng.step() + eng.step():             # prefill + one decode: the stream is running
        got += d.new_token_ids
    assert eng.has_unfinished() and len(got) == 2
    eng.runner.loras.unload("a")
    with pytest.raises(EngineError, match="unknown LoRA adapter 'a'"):
        eng.add_request("t", PROMPT, SamplingParams(lora="a", **GREEDY))
    while eng.has_unfinished():
        for d in eng.step():
            got += d.new_token_ids
    assert got == want


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_speculative_decoding_verifies_with_the_adapter(tiny_model, tiny_qwen2_model, adapter, method):
    """The draft (another model without adapters, or prompt lookup) proposes; the target verifies
    with the request's adapter, so greedy outputs equal plain decoding on the adapter."""
    spec = {"method": method, "num_speculative_tokens": 3, "disable_by_batch_size": 64, "min_accepted_tokens": 0}
    spec.update({"model": str(tiny_qwen2_model)} if method == "draft_model" else {"prompt_lookup_max": 3})
    prompts = [PROMPT, PROMPT[:7] * 3]
    params = [SamplingParams(lora=r, **{**GREEDY, "max_tokens": 16, "min_tokens": 16}) for r in ("a", None)]
    plain = LLM(tiny_model, max_loras=1, num_kv_blocks=32, lora_modules={"a": adapter})
    fast = LLM(tiny_model, max_loras=1, num_kv_blocks=32, lora_modules={"a": adapter}, speculative_config=spec)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in fast.generate(prompts, params)] == want
    assert fast.engine.stats().spec_drafted_tokens > 0
