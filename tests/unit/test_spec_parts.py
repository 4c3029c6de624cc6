"""The parts of speculative decoding on their own: the option, prompt lookup, the verifier's
rules, KV rollback, the scheduler's budget, the back-offs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from backend.config import EngineArgs
from backend.kv_cache.manager import KVCacheManager
from backend.engine.admission import SamplingParams
from backend.serving.repository import parse_engine_options
from backend.spec.config import SpeculativeConfig
from backend.spec.ngram import NgramProposer, find_continuation
from backend.spec.verify import _greedy_run
from tests.unit.spec_helpers import DistributionProposer, V, markov_engine, markov_table, run_all


def test_config_in_vllm_spelling_from_dict_and_json():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 4, 4)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_min == 5
    assert SpeculativeConfig.parse({"model": "/m", "num_speculative_tokens": 2}).method == "draft_model"
    assert SpeculativeConfig.parse("") is None and SpeculativeConfig.parse(None) is None
    for bad, word in [({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                      ({"method": "ngram"}, "num_speculative_tokens"),
                      ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                        "prompt_lookup_max": 2}, "prompt_lookup_min"),
                      ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
                      ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "typo"),
                      ("{not json", "JSON")]:
        with pytest.raises(ValueError, match=word):
            SpeculativeConfig.parse(bad)


def test_engine_option_accepted_by_engine_args_and_serve():
    text = '{"method": "ngram", "num_speculative_tokens": 4}'
    assert EngineArgs.from_dict({"speculative_config": text}).engine.speculative_config == text
    assert parse_engine_options([f"speculative_config={text}"]) == {"speculative_config": text}
    with pytest.raises(ValueError, match="method"):
        parse_engine_options(['speculative_config={"method": "x", "num_speculative_tokens": 1}'])


def test_prompt_lookup_longest_ngram_most_recent_full_continuation():
    t = np.array([5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 1, 2, 3])
    assert find_continuation(t, 1, 3, 2) == [7, 8]          # "1 2 3" most recent with 2 after
    assert find_continuation(t, 1, 3, 4) == [7, 8, 4, 1]
    assert find_continuation(np.array([4, 4, 4, 4]), 1, 2, 3) == [4, 4]   # a loop: earliest, longest
    assert find_continuation(np.array([1, 2, 3, 4]), 1, 3, 3) == []       # nothing repeats
    assert find_continuation(np.array([1, 2, 6, 2]), 2, 3, 3) == []       # only a 1-gram matches
    assert find_continuation(np.array([1, 2, 6, 2]), 1, 3, 3) == [6, 2]


def test_greedy_run_accepts_the_matching_prefix_plus_one():
    assert _greedy_run([4, 5, 6], [4, 5, 9, 1]) == [4, 5, 9]
    assert _greedy_run([4, 5], [4, 5, 7]) == [4, 5, 7]      # all accepted: bonus token
    assert _greedy_run([3], [4, 0]) == [4]


def test_kv_truncate_releases_tail_blocks_and_keeps_committed_ones():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.acquire_prefix("s", [], None)
    assert kv.allocate_slots("s", 14)                       # 4 blocks
    toks = list(range(100, 114))
    kv.commit("s", toks, 9)                                 # 2 full blocks hashed
    kv.truncate("s", 10)
    assert len(kv.block_table("s")) == 3 and kv.stats().num_used_blocks == 3
    kv.check_integrity()
    with pytest.raises(AssertionError):
        kv.truncate("s", 4)                                 # would drop a committed block
    kv.free("s")
    assert kv.stats().num_used_blocks == 0


def test_drafts_are_trimmed_to_the_token_budget_and_rolled_back():
    table = markov_table()
    engine = markov_engine(table, DistributionProposer(torch.full((V,), 1.0 / V), point_mass=True), k=6,
                           max_num_batched_tokens=4, block_size=2)
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.step()                                            # prefill (3 tokens)
    for _ in range(8):
        engine.step()
        seq = engine.scheduler.requests["a"].seqs[0]
        batch = engine.runner.calls[-1]
        assert len(batch.input_ids) <= 4                     # 1 + at most 3 drafts: the budget
        assert seq.num_computed_tokens == seq.num_tokens - 1 and not seq.spec_token_ids
        assert len(engine.kv.block_table(seq.seq_id)) == -(-seq.num_tokens // 2)   # tail freed
        engine.kv.check_integrity()
    assert engine.stats().spec_drafted_tokens > 0


def test_batch_back_off_and_per_sequence_back_off():
    table = markov_table()
    engine = markov_engine(table, NgramProposer(1, 2))
    engine.speculator.config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                                        "disable_by_batch_size": 3})
    reqs = [(f"r{i}", [1, 2, 1, 2, 1, 2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
            for i in range(3)]
    run_all(engine, reqs)
    assert engine.stats().spec_drafted_tokens == 0            # 3 running: no speculation
    # A proposer that is always wrong gets paused: far fewer drafts than steps.
    bad = markov_engine(table, DistributionProposer(torch.eye(V)[7], point_mass=True), k=2)
    bad.speculator.config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                                     "min_accepted_tokens": 1})
    run_all(bad, [("x", [1, 2, 3], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True,
                                                  stop_token_ids=[]))])
    s = bad.stats()
    assert s.spec_accepted_tokens <= 2 and s.spec_num_drafts < 15
