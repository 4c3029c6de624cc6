"""The offline benchmark's workload and the static baseline's padding arithmetic."""
from __future__ import annotations

import pytest

from load.bench_offline import make_requests, markdown, padding_waste


def test_offline_workload_is_seeded_with_the_specified_distributions():
    vocab = list(range(1000))
    reqs = make_requests(256, seed=0, vocab_ids=vocab)
    assert reqs == make_requests(256, seed=0, vocab_ids=vocab) != make_requests(256, seed=1, vocab_ids=vocab)
    plens, olens = [len(p) for p, _ in reqs], [o for _, o in reqs]
    assert min(plens) >= 8 and max(plens) <= 256 and 100 < sum(plens) / 256 < 160
    assert min(olens) >= 1 and max(olens) <= 256 and 50 < sum(olens) / 256 < 80


def test_padding_waste_counts_prefill_and_decode_slots():
    # one group of two: prompts 2 and 4 (pad to 4), outputs 1 and 3 (decode to 3)
    reqs = [([1, 2], 1), ([1, 2, 3, 4], 3)]
    w = padding_waste(reqs, group=2)
    assert w["prefill_waste"] == pytest.approx(1 - 6 / 8)
    assert w["decode_waste"] == pytest.approx(1 - 4 / 6)
    assert w["total_waste"] == pytest.approx(1 - 10 / 14)
    assert w["ceiling_speedup"] == pytest.approx(14 / 10)
    assert padding_waste([([1], 2)] * 4, group=2)["total_waste"] == 0.0


def test_markdown_table_has_one_row_per_model():
    r = {"model": "m", "engine": {"output_throughput": 100.0},
         "hf_sequential": {"output_throughput": 10.0, "extrapolated": True, "sampled_requests": 8},
         "static": {"output_throughput": 50.0, "extrapolated": False, "sampled_groups": 16},
         "ratio_engine_vs_hf_sequential": 10.0, "ratio_engine_vs_static": 2.0, "ratio_engine_vs_static_cpu": 3.0,
         "static_padding": {"total_waste": 0.4, "ceiling_speedup": 1 / 0.6}, "greedy_outputs_equal_hf": "8/8"}
    lines = markdown([r]).splitlines()
    assert len(lines) == 3 and "| m | 100 | 10.0 (sample 8) | 50 | 10.0x | 2.00x | 3.00x | 40% (≤ 1.67x) | 8/8 |" == lines[2]
