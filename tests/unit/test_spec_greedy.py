"""Greedy decoding with speculation equals greedy decoding without it, token for token.

Real checkpoints (the tiny presets), fp32, mixed batches: prompts that copy (prompt lookup gets
long accepted runs), prompts that do not, requests that opt out, sampled requests in the same
batch, n = 2, a KV pool small enough to preempt mid-speculation, and a draft model (the same
checkpoint drafting for itself accepts everything; ``tiny`` drafting for ``tiny-qwen2`` accepts
little). Afterwards no KV block is held, in the target's pool or the draft's.
"""
from __future__ import annotations

import pytest
import torch

from backend import LLM, SamplingParams
from tests.conftest import model_dir
from tests.unit.test_engine_greedy import PROMPTS, hf_reference

MAX_NEW = 16


def copy_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for n in (6, 11, 20):
        piece = torch.randint(3, 3000, (n,), generator=g).tolist()
        out.append(piece * 4)                    # the model tends to keep repeating it
    return out


MIXED = PROMPTS[:8] + copy_prompts()
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "min_accepted_tokens": 0, "disable_by_batch_size": 64}


def greedy(max_new: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_new, min_tokens=max_new, **kw)


def outputs(llm: LLM, prompts, params) -> list[list[tuple[int, ...]]]:
    return [[tuple(c.token_ids) for c in o.outputs] for o in llm.generate(prompts, params)]


def check_clean(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.kv.num_used_blocks == 0 and stats.num_running == 0 and stats.num_waiting == 0
    llm.engine.kv.check_integrity()
    llm.engine.speculator.proposer.check_idle()


@pytest.fixture(scope="module")
def plain():
    llm = LLM(model_dir("tiny"), num_kv_blocks=256)
    return {"mixed": outputs(llm, MIXED, greedy())}


@pytest.mark.parametrize("spec", ["ngram", "self_draft"])
def test_greedy_equals_plain_and_transformers(plain, spec):
    cfg = NGRAM if spec == "ngram" else {"method": "draft_model", "model": str(model_dir("tiny")),
                                         "num_speculative_tokens": 3, "disable_by_batch_size": 64}
    llm = LLM(model_dir("tiny"), num_kv_blocks=256, speculative_config=cfg)
    got = outputs(llm, MIXED, greedy())
    assert got == plain["mixed"]
    hf = hf_reference("tiny")                      # transformers greedy, fp32 (first 12 tokens)
    assert [o[0][:12] for o in got[:8]] == [tuple(h) for h in hf[:8]]
    stats = llm.engine.stats()
    assert stats.spec_accepted_tokens > 30
    if spec == "self_draft":                       # a model agrees with itself: all accepted
        assert stats.spec_accepted_tokens == stats.spec_drafted_tokens
    assert stats.num_steps < 12 + MAX_NEW          # fewer steps than one token per step
    check_clean(llm)


def test_mixed_batch_opt_out_sampled_n2_and_preemption(plain):
    """Speculating and non-speculating requests in one batch, with a pool that preempts."""
    prompts = MIXED[3:]
    params = [greedy(speculative=(i % 3 != 0)) for i in range(len(prompts))]
    params.append(SamplingParams(temperature=0.9, max_tokens=MAX_NEW, seed=5, n=2))   # sampled, n=2
    params.append(greedy(n=2))
    llm = LLM(model_dir("tiny"), num_kv_blocks=24, block_size=8, max_num_batched_tokens=64,
              speculative_config=NGRAM)
    got = outputs(llm, prompts + [prompts[-1], prompts[-2]], params)
    assert got[:len(prompts)] == plain["mixed"][3:]
    assert got[-1] == [plain["mixed"][-2][0]] * 2          # greedy n=2: both choices the same
    assert len(got[-2]) == 2 and all(len(c) == MAX_NEW for c in got[-2])
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_accepted_tokens > 0
    check_clean(llm)


def test_draft_model_of_another_size_and_arch(plain):
    """``tiny`` (Llama) drafting for ``tiny-qwen2`` (same tokenizer): few drafts accepted, same output."""
    base = LLM(model_dir("tiny-qwen2"), num_kv_blocks=256)
    want = outputs(base, MIXED[-4:], greedy())
    llm = LLM(model_dir("tiny-qwen2"), num_kv_blocks=256, speculative_config={
        "method": "draft_model", "model": str(model_dir("tiny")), "num_speculative_tokens": 2,
        "min_accepted_tokens": 0})
    assert outputs(llm, MIXED[-4:], greedy()) == want
    assert llm.engine.stats().spec_drafted_tokens > 0
    check_clean(llm)


def test_abort_mid_speculation_frees_everything():
    llm = LLM(model_dir("tiny"), num_kv_blocks=256, speculative_config={
        "method": "draft_model", "model": str(model_dir("tiny")), "num_speculative_tokens": 3})
    engine = llm.engine
    for i, p in enumerate(MIXED[:6]):
        engine.add_request(f"a{i}", p, greedy(64))
    for _ in range(4):
        engine.step()
    assert engine.stats().spec_drafted_tokens > 0
    assert engine.speculator.proposer.kv.stats().num_used_blocks > 0
    for i in range(6):
        assert engine.abort_request(f"a{i}")
    finals = engine.step()
    assert {d.request_id for d in finals if d.finished} == {f"a{i}" for i in range(6)}
    assert not engine.has_unfinished()
    check_clean(llm)


def test_stop_string_and_max_tokens_inside_an_accepted_run():
    """A stop string (or max_tokens) reached in the middle of an accepted run ends the output
    exactly where plain decoding ends it."""
    d = model_dir("tiny")
    plain = LLM(d, num_kv_blocks=256)
    prompt = copy_prompts()[1]
    full = plain.generate([prompt], greedy(40))[0].outputs[0]
    assert len(full.text) > 20
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    cfg = {"method": "draft_model", "model": str(d), "num_speculative_tokens": 6}   # accepts everything
    spec = LLM(d, num_kv_blocks=256, speculative_config=cfg)
    for params in (SamplingParams(temperature=0, max_tokens=40, stop=[stop]),
                   SamplingParams(temperature=0, max_tokens=13),
                   SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[full.token_ids[17]])):
        want = plain.generate([prompt], params)[0].outputs[0]
        got = spec.generate([prompt], params)[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    assert spec.engine.stats().spec_accepted_tokens > 0
    check_clean(spec)


def test_greedy_logprobs_are_the_targets(plain):
    params = greedy(logprobs=2)
    want = LLM(model_dir("tiny"), num_kv_blocks=256).generate(MIXED[-2:], params)
    got = LLM(model_dir("tiny"), num_kv_blocks=256, speculative_config=NGRAM).generate(MIXED[-2:], params)
    for w, g in zip(want, got):
        wl, gl = w.outputs[0].logprobs, g.outputs[0].logprobs
        assert [x.token_id for x in wl] == [x.token_id for x in gl]
        assert [x.logprob for x in gl] == pytest.approx([x.logprob for x in wl], abs=1e-4)
        assert [[t for t, _ in x.top] for x in gl] == [[t for t, _ in x.top] for x in wl]
