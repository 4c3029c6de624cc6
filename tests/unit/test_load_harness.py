"""The benchmark harness against a fake backend: workloads, arrivals, the runner (concurrency,
cancels, multi-turn histories), the summary arithmetic, work counters and plots."""
from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

from load.backends import Backend, Piece
from load.bench import bench_point, build_parser, parse_slo
from load.counters import engine_counters, from_prometheus, parse_prometheus, work_delta
from load.runner import arrival_times, run_jobs
from load.summary import RequestRecord, json_safe, percentile, summarize
from load.workloads import Job, Turn, WorkloadSpec, make_workload


class FakeBackend(Backend):
    """Streams ``max_tokens`` one-token pieces, ``gap`` seconds apart; records what it saw."""
    name = "fake"

    def __init__(self, gap: float = 0.002, fail_ids: tuple[str, ...] = ()) -> None:
        self.gap = gap
        self.fail_ids = fail_ids
        self.in_flight = 0
        self.max_in_flight = 0
        self.aborted: list[str] = []
        self.seen: dict[str, list[dict]] = {}
        self.kv = 0.0
        self.generated = 0

    async def stream(self, request_id, messages, max_tokens):
        self.seen[request_id] = messages
        if request_id in self.fail_ids:
            raise RuntimeError("boom")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.kv += 0.01
        done = False
        try:
            for i in range(max_tokens):
                await asyncio.sleep(self.gap)
                self.generated += 1
                last = i == max_tokens - 1
                yield Piece(f"w{i} ", 1, "length" if last else None,
                            prompt_tokens=10 if last else None, completion_tokens=max_tokens if last else None,
                            cached_tokens=4 if last else None)
            done = True
        finally:
            self.in_flight -= 1
            self.kv -= 0.01
            if not done:
                self.aborted.append(request_id)

    async def counters(self):
        return {"generation_tokens": float(self.generated), "kv_usage": max(0.0, round(self.kv, 6))}


def run(coro):
    return asyncio.run(coro)


# --- workloads -------------------------------------------------------------------------------------

def test_workloads_are_seeded_and_shaped():
    a = make_workload(WorkloadSpec(name="mixed", num_jobs=8, seed=1, input_len=40, output_len=20))
    b = make_workload(WorkloadSpec(name="mixed", num_jobs=8, seed=1, input_len=40, output_len=20))
    c = make_workload(WorkloadSpec(name="mixed", num_jobs=8, seed=2, input_len=40, output_len=20))
    assert [j.turns for j in a] == [j.turns for j in b] and [j.turns for j in a] != [j.turns for j in c]
    assert all(20 <= j.prompt_len <= 60 and 10 <= j.turns[0].max_tokens <= 30 for j in a)
    assert len({j.turns[0].user[:8] for j in a}) == 8            # unique tags: no accidental prefixes

    sp = make_workload(WorkloadSpec(name="shared-prefix", num_jobs=8, num_groups=2, prefix_len=64))
    assert len({j.system for j in sp}) == 2 and sp[0].system == sp[2].system != sp[1].system

    mt = make_workload(WorkloadSpec(name="multi-turn", num_jobs=3, turns=3, history_len=100, followup_len=10))
    assert [len(j.turns) for j in mt] == [3, 3, 3] and len(mt[0].turns[0].user) > 4 * len(mt[0].turns[1].user)

    cs = make_workload(WorkloadSpec(name="cancel-storm", num_jobs=64, cancel_after=(1, 8)))
    assert all(1 <= j.turns[0].cancel_after <= 8 for j in cs)
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload(WorkloadSpec(name="nope"))


def test_poisson_arrivals_are_seeded_with_the_right_mean():
    t = arrival_times(4000, 8.0, seed=3)
    assert t == arrival_times(4000, 8.0, seed=3) and t[0] == 0.0
    assert all(b >= a for a, b in zip(t, t[1:]))
    assert abs(t[-1] / (len(t) - 1) - 1 / 8.0) < 0.01
    assert arrival_times(3, math.inf, 0) == [0.0, 0.0, 0.0] == arrival_times(3, None, 0)
    with pytest.raises(ValueError):
        arrival_times(3, 0.0, 0)


# --- summary ---------------------------------------------------------------------------------------

def test_percentile_matches_numpy():
    xs = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    for p in (0, 50, 90, 99, 100):
        assert percentile(xs, p) == pytest.approx(np.percentile(xs, p))
    assert math.isnan(percentile([], 50))


def test_summary_arithmetic_and_goodput():
    recs = [
        RequestRecord("a", "a", 0, 0.0, ok=True, ttft=0.1, latency=1.1, itl=[0.1] * 10, output_tokens=11,
                      prompt_tokens=5),
        RequestRecord("b", "b", 0, 0.0, ok=True, ttft=0.3, latency=2.3, itl=[0.2] * 10, output_tokens=11,
                      prompt_tokens=5),
        RequestRecord("c", "c", 0, 0.0, ok=True, cancelled=True, ttft=0.1, latency=0.2, output_tokens=2),
        RequestRecord("d", "d", 0, 0.0, error="x"),
    ]
    s = summarize(recs, duration=2.0, slo_ms={"ttft": 200, "tpot": 150})
    assert (s["requests"], s["completed"], s["cancelled"], s["failed"]) == (4, 2, 1, 1)
    assert s["output_throughput"] == 11.0 and s["request_throughput"] == 1.0
    assert s["total_token_throughput"] == 16.0
    assert s["tpot_ms"]["mean"] == pytest.approx(150.0)          # (100 + 200) / 2
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["itl_ms"]["p50"] == pytest.approx(150.0)
    assert s["goodput"] == 0.5 and s["slo_attainment"] == 0.5    # only "a" meets ttft <= 200 ms
    assert json.dumps(json_safe(summarize([], 1.0)), allow_nan=False)
    with pytest.raises(ValueError, match="unknown SLO"):
        summarize(recs, 1.0, {"latency": 1})
    assert parse_slo(["ttft=500", "e2el=2000"]) == {"ttft": 500.0, "e2el": 2000.0}


# --- runner ----------------------------------------------------------------------------------------

def test_fixed_concurrency_is_respected_and_everything_completes():
    be = FakeBackend()
    jobs = [Job(f"j{i}", [Turn(f"q{i}", 5)]) for i in range(20)]
    recs, duration = run(run_jobs(be, jobs, concurrency=4, progress=False))
    assert be.max_in_flight == 4 and len(recs) == 20 and all(r.ok for r in recs)
    assert all(r.output_tokens == 5 and r.prompt_tokens == 10 and r.cached_tokens == 4 for r in recs)
    assert all(r.ttft is not None and len(r.itl) == 4 and r.chunks == 5 for r in recs)
    assert duration > 0 and be.aborted == []


def test_cancel_stops_the_stream_and_the_backend_cleans_up():
    be = FakeBackend()
    jobs = [Job(f"c{i}", [Turn("x", 100, cancel_after=1 + i % 3)]) for i in range(6)]
    recs, _ = run(run_jobs(be, jobs, request_rate=math.inf, progress=False))
    assert all(r.cancelled and r.ok for r in recs)
    assert sorted(r.chunks for r in recs) == [1, 1, 2, 2, 3, 3]
    assert sorted(be.aborted) == sorted(f"c{i}-t0" for i in range(6))
    assert be.in_flight == 0 and be.kv == pytest.approx(0.0)


def test_multi_turn_resends_the_history_with_the_replies():
    be = FakeBackend()
    job = Job("conv", [Turn("first", 2), Turn("second", 3), Turn("third", 1)], system="sys")
    recs, _ = run(run_jobs(be, [job], concurrency=1, progress=False))
    assert [r.turn for r in recs] == [0, 1, 2]
    assert be.seen["conv-t2"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "first"}, {"role": "assistant", "content": "w0 w1 "},
        {"role": "user", "content": "second"}, {"role": "assistant", "content": "w0 w1 w2 "},
        {"role": "user", "content": "third"}]


def test_a_failed_turn_is_recorded_and_ends_its_conversation():
    be = FakeBackend(fail_ids=("conv-t1",))
    recs, _ = run(run_jobs(be, [Job("conv", [Turn("a", 2), Turn("b", 2), Turn("c", 2)])],
                           concurrency=1, progress=False))
    assert [(r.turn, r.ok) for r in recs] == [(0, True), (1, False)]
    assert "boom" in recs[1].error


def test_bench_point_reports_work_and_kv_back_to_idle():
    be = FakeBackend()
    jobs = [Job(f"c{i}", [Turn("x", 50, cancel_after=2)]) for i in range(8)]
    point = run(bench_point(be, jobs, concurrency=8, request_rate=None, check_idle=True, progress=False))
    s = point["summary"]
    assert s["cancelled"] == 8 and s["kv"]["kv_final"] == 0.0 and s["kv"]["kv_back_to_idle_s"] is not None
    assert s["work"]["generation_tokens"] == 16 and len(point["records"]) == 8


def test_bench_cli_parses_a_sweep():
    args = build_parser().parse_args(["--backend", "engine", "--concurrency", "1", "4", "--slo", "ttft=100"])
    assert args.concurrency == [1, 4] and args.backend == "engine"


# --- counters and plots ----------------------------------------------------------------------------

def test_prometheus_counters_and_deltas():
    text = """# HELP llm_generation_tokens_total x
# TYPE llm_generation_tokens_total counter
llm_generation_tokens_total{model="engine",version="1"} 120
llm_computed_tokens_total{model="engine",version="1"} 500
llm_recomputed_tokens_total{model="engine",version="1"} 20
llm_prompt_tokens_total{model="engine",version="1"} 400
llm_prefix_cache_hits_total{model="engine",version="1"} 100
llm_prefix_cache_queries_total{model="engine",version="1"} 400
llm_kv_cache_usage_ratio{model="engine",version="1"} 0.25
nv_inference_count{model="llm",version="1"} 3
"""
    series = parse_prometheus(text)
    assert series["nv_inference_count"] == 3.0
    after = from_prometheus(series)
    d = work_delta({"generation_tokens": 20.0, "computed_tokens": 100.0, "kv_usage": 0.0}, after)
    assert d["generation_tokens"] == 100 and d["computed_tokens"] == 400 and d["useful_tokens"] == 380
    assert d["kv_usage"] == 0.25 and d["prefix_hit_rate"] == 0.25 and d["prefill_computed_tokens"] == 300

    from backend.engine.llm_engine import EngineStats

    from backend.kv_cache.manager import KVCacheStats

    c = engine_counters(EngineStats(num_running=2, generation_tokens=7, kv_usage=0.5,
                                    kv=KVCacheStats(prefix_queried_tokens=10, prefix_hit_tokens=4)))
    assert c["generation_tokens"] == 7.0 and c["num_running"] == 2.0 and c["kv_usage"] == 0.5
    assert (c["prefix_queried_tokens"], c["prefix_hit_tokens"]) == (10.0, 4.0)


def test_plots_write_pngs(tmp_path):
    from load.plots import plot_bars, plot_series, plot_timeline

    be = FakeBackend(gap=0.0)
    runs = [run(bench_point(be, [Job(f"j{i}", [Turn("x", 4)]) for i in range(4)], concurrency=c,
                            request_rate=None, progress=False)) for c in (1, 2)]
    for path in (plot_series({"fake": runs}, tmp_path / "s.png"),
                 plot_bars({"m": {"a": 1.0, "b": 2.0}}, tmp_path / "b.png", ylabel="tok/s"),
                 plot_timeline([0, 1, 2], [0.0, 0.5, 0.0], tmp_path / "t.png", ylabel="kv",
                               marks={"cancel": 1.0})):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_histogram_quantile_from_bucket_deltas():
    from load.counters import bucket_quantile, histogram_buckets

    def text(counts):
        les = ["0.001", "0.01", "0.1", "+Inf"]
        return "\n".join(f'h_bucket{{model="engine",le="{le}"}} {c}' for le, c in zip(les, counts)) + "\nh_sum 1\n"

    before, after = histogram_buckets(text([1, 1, 1, 1]), "h"), histogram_buckets(text([1, 5, 11, 11]), "h")
    assert after == [(0.001, 1.0), (0.01, 5.0), (0.1, 11.0), (float("inf"), 11.0)]
    # 10 new observations: 4 in (0.001, 0.01], 6 in (0.01, 0.1]
    assert bucket_quantile(0.2, before, after) == pytest.approx(0.001 + 0.009 * 0.5)
    assert bucket_quantile(0.7, before, after) == pytest.approx(0.01 + 0.09 * 0.5)
    assert bucket_quantile(0.5, after, after) is None


def test_a_checkpoint_gets_serves_kv_budget_and_presets_keep_theirs():
    from triton_llm.cli import SERVE_KV_CACHE_MEMORY
    from load.stack import MODEL_OPTIONS, engine_options

    assert engine_options("models/default") == {"kv_cache_memory": SERVE_KV_CACHE_MEMORY}
    assert engine_options("models/default", ["num_kv_blocks=64"]) == {"num_kv_blocks": "64"}
    assert engine_options("bench-15m") == MODEL_OPTIONS["bench-15m"]
    assert engine_options("build/models/tiny", ["num_threads=1"]) == {"num_threads": "1"}
