"""Write dashboards/llm-serving.json from the panel table below (run after changing a panel).

    python docker/grafana/make_dashboard.py

Metric names are the engine's (backend/serving metrics, exported on Triton's metrics port) and the
shim's; tests/e2e/test_dashboard_metrics.py checks every name queried here against a live server.
"""
from __future__ import annotations

import json
import pathlib
import re

OUT = pathlib.Path(__file__).parent / "dashboards" / "llm-serving.json"
DS = {"type": "prometheus", "uid": "prometheus"}


def _q(metric: str, quantile: float, window: str = "1m") -> str:
    return f"histogram_quantile({quantile}, sum by (le) (rate({metric}_bucket[{window}])))"


# (title, unit, [(legend, PromQL)]); one row of two panels per pair.
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Time to first token", "s", [
        ("p50", _q("llm_time_to_first_token_seconds", 0.5)),
        ("p99", _q("llm_time_to_first_token_seconds", 0.99))]),
    ("Inter-token latency", "s", [
        ("p50", _q("llm_inter_token_latency_seconds", 0.5)),
        ("p99", _q("llm_inter_token_latency_seconds", 0.99))]),
    ("Throughput (tokens/s)", "short", [
        ("output", "sum(rate(llm_generation_tokens_total[1m]))"),
        ("prompt", "sum(rate(llm_prompt_tokens_total[1m]))")]),
    ("Requests/s", "reqps", [
        ("finished {{reason}}", "sum by (reason) (rate(llm_requests_finished_total[1m]))"),
        ("aborted", "sum(rate(llm_requests_aborted_total[1m]))")]),
    ("Queue", "short", [
        ("running", "sum(llm_num_requests_running)"),
        ("waiting", "sum(llm_num_requests_waiting)")]),
    ("Queue time / end-to-end latency", "s", [
        ("queue p99", _q("llm_queue_time_seconds", 0.99)),
        ("end-to-end p50", _q("llm_e2e_request_latency_seconds", 0.5)),
        ("end-to-end p99", _q("llm_e2e_request_latency_seconds", 0.99))]),
    ("KV cache usage", "percentunit", [
        ("device", "max(llm_kv_cache_usage_ratio)")]),
    ("Prefix cache hit rate", "percentunit", [
        ("hit rate", "sum(rate(llm_prefix_cache_hits_total[5m])) / "
                     "clamp_min(sum(rate(llm_prefix_cache_queries_total[5m])), 1)")]),
    ("Aborts and preemptions", "short", [
        ("aborted / min", "sum(increase(llm_requests_aborted_total[1m]))"),
        ("preempted / min", "sum(increase(llm_num_preemptions_total[1m]))")]),
    ("Cancel-to-free time", "s", [
        ("p50", _q("llm_abort_to_free_seconds", 0.5)),
        ("p99", _q("llm_abort_to_free_seconds", 0.99))]),
    ("Rejected requests / min (by reason)", "short", [
        ("{{reason}}", "sum by (reason) (increase(llm_requests_rejected_total[1m]))")]),
    ("Engine health and KV tiers", "short", [
        ("engine healthy", "min(llm_engine_healthy)"),
        ("evictions / min", "sum(increase(llm_kv_cache_evictions_total[1m]))"),
        ("offload out MB / min", "sum(increase(llm_kv_offload_out_bytes_total[1m])) / 1e6"),
        ("offload in MB / min", "sum(increase(llm_kv_offload_in_bytes_total[1m])) / 1e6")]),
]


def panel(i: int, title: str, unit: str, targets: list[tuple[str, str]]) -> dict:
    return {
        "id": i + 1, "type": "timeseries", "title": title, "datasource": DS,
        "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
        "fieldConfig": {"defaults": {"unit": unit, "min": 0}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                    "tooltip": {"mode": "multi"}},
        "targets": [{"refId": chr(65 + j), "datasource": DS, "expr": expr, "legendFormat": legend}
                    for j, (legend, expr) in enumerate(targets)],
    }


def dashboard() -> dict:
    return {
        "uid": "triton-llm", "title": "LLM serving (Triton engine)", "tags": ["triton", "llm"],
        "timezone": "browser", "schemaVersion": 39, "version": 1, "refresh": "5s",
        "time": {"from": "now-30m", "to": "now"},
        "panels": [panel(i, *p) for i, p in enumerate(PANELS)],
    }


_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                 "unless", "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Series names a PromQL expression reads (functions, grouping labels, ranges left out)."""
    expr = re.sub(r'"[^"]*"', "", expr)                        # strings
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)           # label matchers, ranges
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", expr):   # not 1e3, 5m
        rest = expr[m.end():].lstrip()
        if not rest.startswith("(") and m.group() not in _PROMQL_WORDS:
            names.add(m.group())
    return names


def dashboard_metric_names(dash: dict) -> set[str]:
    return {n for p in dash["panels"] for t in p.get("targets", []) for n in metric_names(t["expr"])}


if __name__ == "__main__":
    OUT.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {OUT}")
