"""Per-request records and the run summary, in the terms of vLLM's ``benchmark_serving``:

    TTFT   arrival -> first chunk with content
    ITL    gaps between consecutive chunks with content
    TPOT   (end-to-end - TTFT) / (output tokens - 1), per request
    E2EL   arrival -> last chunk
    goodput  requests/s that met every given SLO (ms): ttft, tpot, e2el

Cancelled and failed requests count in ``completed``'s complement, not in latencies or throughput.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    request_id: str
    job_id: str
    turn: int
    start: float                    # seconds since the run began
    ok: bool = False
    cancelled: bool = False
    error: str = ""
    ttft: float | None = None       # seconds
    latency: float = 0.0            # seconds, end to end (to the cancel for a cancelled request)
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    chunks: int = 0                 # chunks with content

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        d = asdict(self)
        d["tpot"] = self.tpot
        return d


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _stats_ms(values: list[float]) -> dict[str, float]:
    ms = [v * 1000.0 for v in values]
    out = {"mean": sum(ms) / len(ms) if ms else math.nan}
    out.update({f"p{p}": percentile(ms, p) for p in PERCENTILES})
    return out


def meets_slo(r: RequestRecord, slo_ms: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}
    for key, limit in slo_ms.items():
        if key not in values:
            raise ValueError(f"unknown SLO {key!r}; use ttft, tpot or e2el")
        v = values[key]
        if v is not None and v * 1000.0 > limit:
            return False
    return True


def summarize(records: list[RequestRecord], duration: float,
              slo_ms: dict[str, float] | None = None) -> dict:
    done = [r for r in records if r.ok and not r.cancelled]
    out_tok = sum(r.output_tokens for r in done)
    in_tok = sum(r.prompt_tokens for r in done)
    s = {
        "requests": len(records),
        "completed": len(done),
        "cancelled": sum(r.cancelled for r in records),
        "failed": sum(not r.ok for r in records),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(done) / duration if duration > 0 else math.nan,
        "output_throughput": out_tok / duration if duration > 0 else math.nan,
        "total_token_throughput": (in_tok + out_tok) / duration if duration > 0 else math.nan,
        "total_output_tokens": out_tok,
        "total_prompt_tokens": in_tok,
        "cached_prompt_tokens": sum(r.cached_tokens for r in done),
        "ttft_ms": _stats_ms([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": _stats_ms([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": _stats_ms([g for r in done for g in r.itl]),
        "e2el_ms": _stats_ms([r.latency for r in done]),
    }
    if slo_ms:
        good = sum(meets_slo(r, slo_ms) for r in done)
        s["slo_ms"] = dict(slo_ms)
        s["goodput"] = good / duration if duration > 0 else math.nan
        s["slo_attainment"] = good / len(done) if done else math.nan
    return s


def format_summary(s: dict, title: str = "") -> str:
    """A short text table, like benchmark_serving's."""
    lines = [f"{'=' * 18} {title or 'Serving benchmark'} {'=' * 18}"]

    def row(name: str, value) -> None:
        lines.append(f"{name:<40}{value:>12.2f}" if isinstance(value, float) else f"{name:<40}{value:>12}")

    row("Requests (completed / cancelled / failed)", f"{s['completed']}/{s['cancelled']}/{s['failed']}")
    row("Duration (s)", s["duration_s"])
    row("Request throughput (req/s)", s["request_throughput"])
    row("Output token throughput (tok/s)", s["output_throughput"])
    row("Total token throughput (tok/s)", s["total_token_throughput"])
    if "goodput" in s:
        row(f"Goodput (req/s) under {s['slo_ms']}", s["goodput"])
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E latency")):
        st = s[key]
        row(f"{label} mean / p50 (ms)", f"{st['mean']:.1f} / {st['p50']:.1f}")
        row(f"{label} p90 / p99 (ms)", f"{st['p90']:.1f} / {st['p99']:.1f}")
    work = s.get("work") or {}
    for key in ("computed_tokens", "useful_tokens", "prefill_computed_tokens", "prefix_hit_tokens",
                "prefix_hit_rate", "num_preemptions", "num_aborted", "kv_usage"):
        if key in work:
            row(f"work: {key}", float(work[key]))
    for e in s["errors"]:
        lines.append(f"error: {e[:100]}")
    return "\n".join(lines)


def json_safe(obj):
    """NaN / inf -> None, recursively, so results are strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj
