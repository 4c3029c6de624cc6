"""Greedy outputs of the whole engine equal Hugging Face ``generate`` token for token (fp32),
for 16 mixed-length prompts run together: with prefix caching and repeated prefixes, with
chunked prefill (>= 3 chunks per long prompt) and with a KV pool small enough to preempt."""
from __future__ import annotations

import functools

import pytest
import torch

from backend import LLM, SamplingParams
from tests.conftest import model_dir

MAX_NEW = 12
LENGTHS = [3, 7, 15, 16, 17, 31, 40, 64, 90, 5, 23, 33, 48, 70, 9, 12]
PRESETS = ["tiny", "tiny-qwen2"]


def make_prompts() -> list[list[int]]:
    """Ids 3..2999 (0-2 are special); every third prompt starts with the same 48 tokens."""
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 3000, (48,), generator=g).tolist()
    out = []
    for i, n in enumerate(LENGTHS):
        own = torch.randint(3, 3000, (n,), generator=g).tolist()
        out.append((shared[:min(n - 1, 48)] + own)[:n] if i % 3 == 0 else own)
    return out


PROMPTS = make_prompts()


@functools.cache
def hf_reference(preset: str) -> tuple[tuple[int, ...], ...]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir(preset), dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, pad_token_id=0)
            outs.append(tuple(gen[0, len(p):].tolist()))
    return tuple(outs)


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)


def generate(llm: LLM) -> list[tuple[int, ...]]:
    return [tuple(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]


def check_clean(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.kv.num_used_blocks == 0 and stats.num_running == 0 and stats.num_waiting == 0
    llm.engine.kv.check_integrity()


@pytest.mark.parametrize("preset", PRESETS)
def test_prefix_caching_with_repeated_prefixes(preset):
    llm = LLM(model_dir(preset), block_size=8, num_kv_blocks=256, enable_prefix_caching=True, num_threads=1)
    assert generate(llm) == list(hf_reference(preset))
    outs = llm.generate(PROMPTS, GREEDY)                # second pass: every prompt hits the cache
    assert [tuple(o.outputs[0].token_ids) for o in outs] == list(hf_reference(preset))
    cached = [o.num_cached_tokens for o in outs]
    assert cached == [(n - 1) // 8 * 8 for n in LENGTHS]
    assert llm.engine.stats().kv.prefix_hit_tokens >= sum(cached)
    check_clean(llm)


@pytest.mark.parametrize("preset", PRESETS)
def test_chunked_prefill_three_or_more_chunks(preset):
    llm = LLM(model_dir(preset), block_size=8, num_kv_blocks=256, max_num_batched_tokens=16,
              enable_prefix_caching=False, num_threads=1)
    sched = llm.engine.scheduler
    prefill_chunks: dict[str, int] = {}
    schedule = sched.schedule

    def spy():
        out = schedule()
        for seq, n in out.scheduled:
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                prefill_chunks[seq.seq_id] = prefill_chunks.get(seq.seq_id, 0) + 1
            assert out.num_batched_tokens <= 16
        return out

    sched.schedule = spy
    assert generate(llm) == list(hf_reference(preset))
    long_ids = [f"llm-{i}#0" for i, n in enumerate(LENGTHS) if n >= 48]
    assert all(prefill_chunks[i] >= 3 for i in long_ids), prefill_chunks
    # alone, no chunk but the last samples: the others must still write their KV
    alone = llm.generate([PROMPTS[8]], GREEDY)[0]
    assert tuple(alone.outputs[0].token_ids) == hf_reference(preset)[8]
    check_clean(llm)


@pytest.mark.parametrize("preset", PRESETS)
def test_preemption_does_not_change_outputs(preset):
    llm = LLM(model_dir(preset), block_size=4, num_kv_blocks=30, max_num_batched_tokens=64,
              num_threads=1)
    assert generate(llm) == list(hf_reference(preset))
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.recomputed_tokens > 0
    check_clean(llm)
