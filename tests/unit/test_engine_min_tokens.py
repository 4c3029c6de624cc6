"""min_tokens as transformers' ``min_new_tokens``: no EOS can be *generated* before min_tokens,
``ignore_eos`` or not, on a checkpoint whose EOS wins early (its lm_head rows scaled up)."""
from __future__ import annotations

import shutil

import pytest
import torch

from backend import LLM, SamplingParams
from tests.conftest import model_dir

EOS = (0, 2)                  # the presets' generation_config eos_token_id
N = 16
PROMPTS = [[5 + 37 * i % 2900 for i in range(k, k + n)] for k, n in ((1, 9), (50, 23), (400, 4), (7, 31))]


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory):
    """tiny-qwen2 (untied lm_head) with the EOS rows scaled 8x: where an EOS logit is positive
    it dominates, so unconstrained greedy decoding hits EOS within a few tokens."""
    from safetensors.torch import load_file, save_file

    src = model_dir("tiny-qwen2")
    out = tmp_path_factory.mktemp("eos-likely")
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    state = load_file(str(src / "model.safetensors"))
    state["lm_head.weight"][list(EOS)] *= 8.0
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def hf_greedy(path, min_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N,
                                 min_new_tokens=min_new_tokens, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


def test_min_tokens_equal_to_max_tokens_never_generates_eos_even_with_ignore_eos(eos_model):
    llm = LLM(eos_model, num_kv_blocks=64, block_size=8, num_threads=1)
    assert sorted(llm.engine.eos_token_ids) == sorted(EOS)
    # The checkpoint does want EOS early: unconstrained, transformers stops and we emit it.
    free = hf_greedy(eos_model, 0)
    assert any(len(t) < N for t in free), free
    emitted = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))
    assert any(set(o.outputs[0].token_ids) & set(EOS) for o in emitted)
    # min_tokens = max_tokens: EOS is masked for every token, as min_new_tokens does.
    ref = hf_greedy(eos_model, N)
    for ignore_eos in (True, False):
        params = SamplingParams(temperature=0, max_tokens=N, min_tokens=N, ignore_eos=ignore_eos)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        assert got == ref, ignore_eos
        assert not any(set(t) & set(EOS) for t in got)
    # Sampled rows obey the mask too.
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=N, min_tokens=N, ignore_eos=True, n=4)
    for out in llm.generate(PROMPTS, params):
        assert all(len(c.token_ids) == N and not set(c.token_ids) & set(EOS) for c in out.outputs)
