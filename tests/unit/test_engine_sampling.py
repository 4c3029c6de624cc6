"""Seeds, n > 1 forks sharing prompt blocks, logprobs: through the real engine (tiny preset)."""
from __future__ import annotations

import pytest
import torch

from backend import LLM, SamplingParams
from tests.conftest import model_dir

PROMPT = list(range(100, 120))          # 20 tokens: one full block of 16 and a partial one


@pytest.fixture(scope="module")
def llm():
    return LLM(model_dir("tiny"), num_kv_blocks=128, num_threads=1)


def others(n, start=300):
    return [list(range(start + 7 * i, start + 7 * i + 5 + 3 * i)) for i in range(n)]


def test_seeded_sampling_is_identical_alone_and_in_different_batches(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=12)
    noisy = SamplingParams(temperature=1.0, max_tokens=7)
    alone = llm.generate([PROMPT], seeded)[0].outputs[0].token_ids
    batch = llm.generate(others(3) + [PROMPT] + others(2, 900),
                         [noisy] * 3 + [seeded] + [SamplingParams(temperature=0.5, seed=7, max_tokens=20)] * 2)
    assert batch[3].outputs[0].token_ids == alone
    # and under preemption (a pool that cannot hold everyone)
    small = LLM(model_dir("tiny"), num_kv_blocks=10, block_size=4, num_threads=1)
    out = small.generate(others(6) + [PROMPT], [noisy] * 6 + [seeded])
    assert out[6].outputs[0].token_ids == alone
    assert small.engine.stats().num_preemptions > 0
    other_seed = llm.generate([PROMPT], SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1235,
                                                       max_tokens=12))[0].outputs[0].token_ids
    assert other_seed != alone


def test_n3_forks_after_the_prompt_and_shares_its_blocks(llm):
    eng = llm.engine
    kv = eng.kv
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6)
    eng.add_request("fork", PROMPT, params, stream=True)
    used0 = kv.stats().num_used_blocks
    deltas = eng.step()                                    # the prompt: then the fork
    assert sorted(d.index for d in deltas) == [0, 1, 2]
    tables = [kv.block_table(f"fork#{i}") for i in range(3)]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 2
    assert [kv.pool.blocks[b].ref_cnt for b in tables[0]] == [3, 3]
    assert kv.stats().num_used_blocks - used0 == 2
    eng.step()                                             # each writes into the shared partial block
    tables = [kv.block_table(f"fork#{i}") for i in range(3)]
    assert tables[0][0] == tables[1][0] == tables[2][0]    # the full prompt block stays shared
    assert kv.pool.blocks[tables[0][0]].ref_cnt == 3
    assert len({t[1] for t in tables}) == 3                # copy-on-write of the partial one
    assert kv.stats().num_used_blocks - used0 == 4 and kv.stats().cow_copies >= 2
    kv.check_integrity()
    while eng.has_unfinished():
        eng.step()
    assert kv.stats().num_used_blocks == 0
    kv.check_integrity()


def test_n3_choices_are_seeded_per_choice_and_distinct(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8)
    out = llm.generate([PROMPT], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    toks = [c.token_ids for c in out.outputs]
    assert len({tuple(t) for t in toks}) == 3
    # choice i draws from seed + i: choice 0 equals n=1 with the same seed, choice 1 seed + 1
    one = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=11, max_tokens=8))[0]
    nxt = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=12, max_tokens=8))[0]
    assert toks[0] == one.outputs[0].token_ids and toks[1] == nxt.outputs[0].token_ids
    assert llm.generate([PROMPT], params)[0].outputs[2].token_ids == toks[2]


def test_logprobs_match_the_raw_model_distribution(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0].outputs[0]
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir("tiny"), dtype=torch.float32)
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([PROMPT + out.token_ids])).logits[0], -1)
    for i, lp in enumerate(out.logprobs):
        row = ref[len(PROMPT) - 1 + i]
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
        assert lp.top[0][0] == lp.token_id                 # greedy: the chosen one is the best
