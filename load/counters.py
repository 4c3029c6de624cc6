"""Work counters of a benchmark run, read the same way from the Triton metrics endpoint (Prometheus
text) and from the in-process engine (``EngineStats``), under one set of names:

    prompt_tokens, prefix_queried_tokens, prefix_hit_tokens, generation_tokens,
    computed_tokens, recomputed_tokens, num_preemptions, num_aborted
                                                       counters: a run reports after - before
    kv_usage, num_running, num_waiting                 gauges: a run reports the value after

``useful`` tokens are ``computed - recomputed``; the prefix hit rate is ``hits / queried`` tokens.
Triton's endpoint has no computed/recomputed token counters (backend/serving/metrics.py), so over
a server the work is read as prompt, prefix-hit and generated tokens, and preemptions.

The Prometheus text format is parsed in one place, ``samples()`` (prometheus_client's own parser);
the load harness and the e2e tests read metrics through the functions here.
"""
from __future__ import annotations

import urllib.request
from typing import Iterator

from prometheus_client.parser import text_string_to_metric_families

# our name -> the engine's Prometheus series (backend/serving metrics, summed over labels)
PROMETHEUS_NAMES = {
    "prompt_tokens": "llm_prompt_tokens_total",
    "prefix_queried_tokens": "llm_prefix_cache_queries_total",
    "prefix_hit_tokens": "llm_prefix_cache_hits_total",
    "generation_tokens": "llm_generation_tokens_total",
    "computed_tokens": "llm_computed_tokens_total",
    "recomputed_tokens": "llm_recomputed_tokens_total",
    "num_preemptions": "llm_num_preemptions_total",
    "num_aborted": "llm_requests_aborted_total",
    "kv_usage": "llm_kv_cache_usage_ratio",
    "num_running": "llm_num_requests_running",
    "num_waiting": "llm_num_requests_waiting",
}
GAUGES = ("kv_usage", "num_running", "num_waiting")

Labels = tuple[tuple[str, str], ...]


def samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """Every sample of a Prometheus text exposition as (series name, labels, value)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            yield s.name, s.labels, float(s.value)


def labelled(text: str, *, prefix: str = "", drop: tuple[str, ...] = ()) -> dict[tuple[str, Labels], float]:
    """{(series name, sorted labels without ``drop``): value} for the series starting with ``prefix``."""
    out: dict[tuple[str, Labels], float] = {}
    for name, labels, value in samples(text):
        if name.startswith(prefix):
            key = (name, tuple(sorted((k, v) for k, v in labels.items() if k not in drop)))
            out[key] = out.get(key, 0.0) + value
    return out


def parse_prometheus(text: str) -> dict[str, float]:
    """Series name -> value summed over its label sets (a histogram's buckets under ``<name>_bucket``)."""
    out: dict[str, float] = {}
    for name, _labels, value in samples(text):
        out[name] = out.get(name, 0.0) + value
    return out


def histogram_buckets(text: str, name: str) -> list[tuple[float, float]]:
    """Cumulative (le, count) of histogram ``name`` summed over its other labels, by le."""
    acc: dict[float, float] = {}
    for series, labels, value in samples(text):
        if series == f"{name}_bucket" and "le" in labels:
            le = float(labels["le"])                   # "+Inf" -> inf
            acc[le] = acc.get(le, 0.0) + value
    return sorted(acc.items())


def scrape_text(metrics_url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(metrics_url, timeout=timeout) as r:
        return r.read().decode("utf-8", "replace")


def bucket_quantile(q: float, before: list[tuple[float, float]], after: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over the observations between two scrapes (linear within a
    bucket; the upper bound of the last finite bucket when it falls in +Inf)."""
    prev = dict(before)
    buckets = [(le, c - prev.get(le, 0.0)) for le, c in after]
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank, lo_le, lo_c = q * total, 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if le == float("inf"):
                return lo_le
            return lo_le + (le - lo_le) * ((rank - lo_c) / (c - lo_c) if c > lo_c else 1.0)
        lo_le, lo_c = le, c
    return lo_le


def from_prometheus(series: dict[str, float]) -> dict[str, float]:
    return {ours: series[theirs] for ours, theirs in PROMETHEUS_NAMES.items() if theirs in series}


def scrape_counters(metrics_url: str, timeout: float = 5.0) -> dict[str, float]:
    return from_prometheus(parse_prometheus(scrape_text(metrics_url, timeout)))


def engine_counters(stats) -> dict[str, float]:
    """``EngineStats`` -> our names."""
    out = {name: float(getattr(stats, name)) for name in PROMETHEUS_NAMES if hasattr(stats, name)}
    out["prefix_queried_tokens"] = float(stats.kv.prefix_queried_tokens)
    out["prefix_hit_tokens"] = float(stats.kv.prefix_hit_tokens)
    out["num_running"] = float(stats.num_running)
    out["num_waiting"] = float(stats.num_waiting)
    return out


def work_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counters as after - before, gauges as after, plus the derived useful tokens and hit rate."""
    out = {k: (after[k] if k in GAUGES else after[k] - before.get(k, 0.0)) for k in after}
    if "computed_tokens" in out:
        out["useful_tokens"] = out["computed_tokens"] - out.get("recomputed_tokens", 0.0)
    if "prompt_tokens" in out and "prefix_hit_tokens" in out:
        # prompt tokens that had to be prefilled (exact without preemptions, which recompute more)
        out["prefill_computed_tokens"] = out["prompt_tokens"] - out["prefix_hit_tokens"]
    if out.get("prefix_queried_tokens"):
        out["prefix_hit_rate"] = out.get("prefix_hit_tokens", 0.0) / out["prefix_queried_tokens"]
    return out
