"""Every llm_ metric is exported on Triton's metrics port and counts exactly what the test did."""
from __future__ import annotations

import uuid

import pytest
from transformers import AutoTokenizer

from backend.serving.metrics import FINISH_REASONS, FINISHED, GAUGES, HISTOGRAMS, REJECT_KINDS, REJECTED, STAT_COUNTERS
from tests.e2e.helpers import generate, metric, scrape
from tests.e2e.settle import settled

pytestmark = pytest.mark.e2e


def test_every_metric_is_exported(triton_server):
    snap = scrape(triton_server)
    names = {name for name, _ in snap}
    for name in list(GAUGES) + list(STAT_COUNTERS):
        assert name in names, name
    for name in HISTOGRAMS:
        assert {f"{name}_count", f"{name}_sum", f"{name}_bucket"} <= names, name
    assert {labels for name, labels in snap if name == FINISHED} == {(("reason", r),) for r in FINISH_REASONS}
    assert {labels for name, labels in snap if name == REJECTED} == {(("reason", r),) for r in REJECT_KINDS}
    assert metric(snap, "llm_engine_healthy") == 1
    assert triton_server.engine_healthy() is True       # what `triton-llm serve` watches


def test_metric_values_match_the_requests(triton_server):
    tok = AutoTokenizer.from_pretrained(str(triton_server.model_dir))
    # settled: the previous tests' counters are all written (they lag the gauges: metrics.py)
    before = settled(lambda: scrape(triton_server), ready=lambda s: metric(s, "llm_num_requests_running") == 0
                     and metric(s, "llm_num_requests_waiting") == 0)
    # Short unique prompts (< one KV block): no prefix-cache hits, exact token counts.
    prompts = [f"m {uuid.uuid4().hex[:6]}" for _ in range(3)]
    lens = [len(tok.encode(p)) for p in prompts]
    assert max(lens) < 16
    streams = [generate(triton_server, "llm", text=p, max_tokens=5, temperature=0.0, ignore_eos=True)
               for p in prompts[:2]]
    whole = generate(triton_server, "engine", input_ids=tok.encode(prompts[2]), max_tokens=3,
                     temperature=0.0, ignore_eos=True, stream=False)
    assert all(r.error is None and r.finish_reason == "length" for r in streams + [whole])

    def d(snap, name, **labels):
        return metric(snap, name, **labels) - metric(before, name, **labels)

    # every series written (the token counters and histograms at the stats poll, after the
    # gauges), and nothing more coming: then the deltas are exact
    after = settled(lambda: scrape(triton_server), ready=lambda s: d(s, FINISHED, reason="length") >= 3
                    and d(s, "llm_generation_tokens_total") >= 13
                    and d(s, "llm_e2e_request_latency_seconds_count") >= 3
                    and d(s, "llm_inter_token_latency_seconds_count") >= sum(r.responses - 1 for r in streams))
    assert d(after, FINISHED, reason="length") == 3
    assert d(after, "llm_prompt_tokens_total") == sum(lens)
    assert d(after, "llm_generation_tokens_total") == 5 + 5 + 3
    assert d(after, "llm_prefix_cache_queries_total") == sum(lens)
    assert d(after, "llm_prefix_cache_hits_total") == 0
    assert d(after, "llm_time_to_first_token_seconds_count") == 2          # streamed requests only
    assert d(after, "llm_inter_token_latency_seconds_count") == sum(r.responses - 1 for r in streams)
    assert d(after, "llm_e2e_request_latency_seconds_count") == 3
    assert d(after, "llm_queue_time_seconds_count") == 3
    assert d(after, "llm_requests_aborted_total") == 0
    assert d(after, "llm_num_preemptions_total") == 0
    for r in streams:
        assert r.choices[0].final["metrics"]["ttft"] > 0
    assert 0 < d(after, "llm_e2e_request_latency_seconds_sum") < 60
    assert metric(after, "llm_num_requests_running") == 0
    assert metric(after, "llm_num_requests_waiting") == 0
    assert metric(after, "llm_kv_cache_usage_ratio") == 0
