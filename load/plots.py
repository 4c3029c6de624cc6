"""PNG plots of benchmark results (matplotlib, Agg: no display needed)."""
from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _x(run: dict) -> tuple[str, float]:
    if run.get("request_rate") is not None:
        return "request rate (req/s)", run["request_rate"]
    return "concurrent streams", run["concurrency"]


def plot_sweep(result: dict, out: str | pathlib.Path, title: str | None = None) -> pathlib.Path:
    """Throughput and latency percentiles against the load points of one result file."""
    return plot_series({result["config"].get("backend", "run"): result["runs"]}, out, title=title or (
        f"{result['config'].get('backend')} / {result['workload']['name']} / "
        f"{pathlib.Path(str(result['config'].get('model'))).name}"))


def plot_series(series: dict[str, list[dict]], out: str | pathlib.Path, title: str = "") -> pathlib.Path:
    """Several labelled sweeps (e.g. full stack vs in-process) on shared axes: output tokens/s,
    TTFT p50/p99, ITL p50/p99."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    xlabel = "load"
    for label, runs in series.items():
        pts = sorted((_x(r)[1], r["summary"]) for r in runs)
        if not pts:
            continue
        xlabel = _x(runs[0])[0]
        xs = [p[0] for p in pts]
        axes[0].plot(xs, [s["output_throughput"] for _, s in pts], marker="o", label=label)
        for ax, key in ((axes[1], "ttft_ms"), (axes[2], "itl_ms")):
            line, = ax.plot(xs, [s[key]["p50"] for _, s in pts], marker="o", label=f"{label} p50")
            ax.plot(xs, [s[key]["p99"] for _, s in pts], marker="x", linestyle="--",
                    color=line.get_color(), label=f"{label} p99")
    for ax, ylabel in zip(axes, ("output tokens/s", "TTFT (ms)", "inter-token latency (ms)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        if xlabel == "concurrent streams":
            ax.set_xscale("log", base=2)
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, out)


def plot_bars(groups: dict[str, dict[str, float]], out: str | pathlib.Path, *, ylabel: str,
              title: str = "", log: bool = False) -> pathlib.Path:
    """Grouped bars: {group: {label: value}} (e.g. {"bench-15m": {"engine": 900, "HF": 60}})."""
    labels = list(dict.fromkeys(lbl for g in groups.values() for lbl in g))
    width = 0.8 / max(1, len(labels))
    fig, ax = plt.subplots(figsize=(2.2 + 2.2 * len(groups), 4))
    for i, lbl in enumerate(labels):
        xs = [j + i * width for j in range(len(groups))]
        vals = [g.get(lbl, 0.0) or 0.0 for g in groups.values()]
        bars = ax.bar(xs, vals, width, label=lbl)
        ax.bar_label(bars, labels=[f"{v:.0f}" if v >= 100 else f"{v:.3g}" for v in vals], fontsize=8)
    ax.set_xticks([j + width * (len(labels) - 1) / 2 for j in range(len(groups))], list(groups))
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    return _save(fig, out)


def plot_timeline(times: list[float], values: list[float], out: str | pathlib.Path, *,
                  ylabel: str, title: str = "", marks: dict[str, float] | None = None) -> pathlib.Path:
    """A gauge over time (e.g. KV usage through a cancel storm), with labelled vertical marks."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(times, values, drawstyle="steps-post")
    for name, t in (marks or {}).items():
        ax.axvline(t, linestyle="--", color="gray")
        ax.annotate(name, (t, max(values or [0]) * 0.95), rotation=90, fontsize=8, ha="right")
    ax.set_xlabel("time (s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return _save(fig, out)


def _save(fig, out) -> pathlib.Path:
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
