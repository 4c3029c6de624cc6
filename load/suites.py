"""The experiments of docs/benchmarks.md, one command each (tables printed and saved as markdown
under load/results/, plots written to docs/img/):

    python -m load.suites overhead     full stack (HTTP shim, gRPC ensemble) vs in-process engine, 32 streams
    python -m load.suites prefix       prefix cache on vs off: shared-prefix and multi-turn workloads
    python -m load.suites concurrency  throughput and latency against 1..64 concurrent streams (full stack)
    python -m load.suites cancel       a storm of 64 cancelled streams (HTTP disconnects, gRPC aborts):
                                       KV usage over time, back to idle, cancel-to-free times
    python -m load.suites locust       both Locust users, headless, against the full stack
    python -m load.suites peers        full stack vs llama.cpp's llama-server and vLLM's CPU backend
                                       (load/peers.py), every dtype each has, at --streams (16 1);
                                       install both once: python -m load.peers install

Every suite takes --models (default bench-15m bench-110m; peers: models/default bench-110m) and --scale (fraction of the default
request counts, for quick runs). Contenders of one table run in the same invocation, one after
the other, with the same workload, seed and engine options.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time

from load.backends import Backend, EngineBackend, GrpcBackend, ShimBackend
from load.bench import bench_point as _bench_point
from load.bench import warm_up
from load.counters import bucket_quantile, histogram_buckets
from load.peers import add_peer_arguments
from load.stack import ROOT, Stack, engine_options, resolve_model
from load.summary import json_safe
from load.workloads import WorkloadSpec, make_workload

RESULTS = ROOT / "load" / "results"
IMG = ROOT / "docs" / "img"


@contextlib.asynccontextmanager
async def serving(kind: str, model: str, options: dict):
    """A started backend of ``kind`` (engine | http | grpc), the stack started here if needed."""
    with contextlib.ExitStack() as ctx:
        if kind == "engine":
            backend: Backend = EngineBackend(resolve_model(model), options)
        else:
            stack = ctx.enter_context(Stack(resolve_model(model), options, shim=kind == "http"))
            backend = (ShimBackend(stack.shim_url, metrics_url=stack.metrics_url) if kind == "http"
                       else GrpcBackend(stack.grpc_url, metrics_url=stack.metrics_url))
        await backend.start()
        try:
            await warm_up(backend, 4)
            yield backend
        finally:
            await backend.close()


async def bench_point(be: Backend, jobs, **kw) -> dict:
    """load.bench.bench_point, loud about failed requests (a table must not hide them)."""
    run = await _bench_point(be, jobs, **kw)
    s = run["summary"]
    if s["failed"]:
        print(f"WARNING {kw.get('desc', '')}: {s['failed']} of {s['requests']} requests failed: {s['errors']}",
              file=sys.stderr, flush=True)
    return run


def _n(base: int, scale: float) -> int:
    return max(4, int(round(base * scale)))


def _fmt(x, spec=".0f") -> str:
    return "–" if x is None else format(x, spec)


# --- overhead ------------------------------------------------------------------------------------

async def suite_overhead(args) -> tuple[str, dict]:
    kinds = ("engine", "grpc", "http")
    spec = WorkloadSpec("mixed", num_jobs=_n(96, args.scale), input_len=128, output_len=128, range_ratio=0.5)
    out, rows = {}, []
    for model in args.models:
        opts = engine_options(model, args.engine_option)
        out[model] = {}
        for kind in kinds:
            async with serving(kind, model, opts) as be:
                out[model][kind] = await bench_point(be, make_workload(spec), concurrency=32, request_rate=None,
                                                     desc=f"{model} {kind}")
        s = {k: out[model][k]["summary"] for k in kinds}
        base = s["engine"]["output_throughput"]
        rows.append(f"| {model} | {base:.0f} | {s['grpc']['output_throughput']:.0f} "
                    f"({s['grpc']['output_throughput'] / base:.0%}) | {s['http']['output_throughput']:.0f} "
                    f"({s['http']['output_throughput'] / base:.0%}) | "
                    + " | ".join(f"{s[k]['ttft_ms']['p50']:.0f} / {s[k]['itl_ms']['p50']:.1f}" for k in kinds) + " |")
    table = "\n".join([
        "| model | in-process tok/s | gRPC ensemble tok/s (of in-process) | HTTP shim tok/s (of in-process) "
        "| TTFT / ITL p50 ms: in-process | gRPC | HTTP |", "|---|---|---|---|---|---|---|", *rows])
    from load.plots import plot_bars

    plot_bars({m: {"in-process engine": out[m]["engine"]["summary"]["output_throughput"],
                   "Triton gRPC ensemble": out[m]["grpc"]["summary"]["output_throughput"],
                   "OpenAI shim (HTTP)": out[m]["http"]["summary"]["output_throughput"]} for m in out},
              IMG / "overhead.png", ylabel="output tokens/s", title="Serving overhead at 32 concurrent streams")
    return table, out


# --- prefix caching ------------------------------------------------------------------------------

def _turn_ttft(run: dict, first: bool) -> float | None:
    from load.summary import percentile

    xs = [r["ttft"] * 1000 for r in run["records"] if r["ok"] and r["ttft"] is not None and (r["turn"] == 0) == first]
    return percentile(xs, 50) if xs else None


async def suite_prefix(args) -> tuple[str, dict]:
    shared = WorkloadSpec("shared-prefix", num_jobs=_n(64, args.scale), num_groups=4, prefix_len=512,
                          input_len=32, output_len=32, range_ratio=0.5)
    multi = WorkloadSpec("multi-turn", num_jobs=_n(12, args.scale), turns=4, history_len=1024,
                         followup_len=32, output_len=32)
    out, rows = {}, []
    for model in args.models:
        out[model] = {}
        for caching in ("on", "off"):
            opts = {**engine_options(model, args.engine_option), "enable_prefix_caching": caching == "on"}
            async with serving("http", model, opts) as be:
                # one conversation at a time, on a fresh server: TTFTs measure prefill, not queueing
                mt = await bench_point(be, make_workload(multi), concurrency=1, request_rate=None,
                                       desc=f"{model} prefix {caching} multi-turn")
                sp = await bench_point(be, make_workload(shared), concurrency=16, request_rate=None,
                                       desc=f"{model} prefix {caching} shared")
                out[model][caching] = {"shared-prefix": sp, "multi-turn": mt}
        for caching in ("on", "off"):
            sp, mt = out[model][caching]["shared-prefix"], out[model][caching]["multi-turn"]
            cold, follow = _turn_ttft(mt, True), _turn_ttft(mt, False)
            ratio = follow / cold if cold and follow else None
            mt["summary"]["followup_ttft_ratio"] = ratio
            rows.append(
                f"| {model} | {caching} | {sp['summary']['output_throughput']:.0f} | "
                f"{sp['summary']['ttft_ms']['p50']:.0f} | {_fmt(sp['summary']['work'].get('prefix_hit_rate'), '.0%')} | "
                f"{_fmt(cold)} | {_fmt(follow)} | {_fmt(ratio, '.1%')} | "
                f"{_fmt(mt['summary']['work'].get('prefix_hit_rate'), '.0%')} |")
    table = "\n".join([
        "| model | prefix cache | shared-prefix tok/s | shared-prefix TTFT p50 ms | hit rate "
        "| multi-turn cold TTFT p50 ms | follow-up TTFT p50 ms | follow-up / cold | hit rate |",
        "|---|---|---|---|---|---|---|---|---|", *rows])
    from load.plots import plot_bars

    plot_bars({f"{m} cache {c}": {"cold (1k-token history)": _turn_ttft(out[m][c]["multi-turn"], True),
                                  "follow-up": _turn_ttft(out[m][c]["multi-turn"], False)}
               for m in out for c in ("on", "off")},
              IMG / "prefix_multiturn.png", ylabel="TTFT p50 (ms)", title="Multi-turn TTFT, prefix cache on vs off")
    plot_bars({m: {f"cache {c}": out[m][c]["shared-prefix"]["summary"]["output_throughput"] for c in ("on", "off")}
               for m in out}, IMG / "prefix_shared.png", ylabel="output tokens/s",
              title="Shared 512-token system prompts, 16 streams")
    return table, out


# --- concurrency sweep ---------------------------------------------------------------------------

async def suite_concurrency(args) -> tuple[str, dict]:
    levels = args.levels
    out, rows = {}, []
    for model in args.models:
        out[model] = []
        async with serving("http", model, engine_options(model, args.engine_option)) as be:
            for c in levels:
                spec = WorkloadSpec("mixed", num_jobs=max(_n(16, args.scale), 2 * c), seed=c,
                                    input_len=128, output_len=128, range_ratio=0.5)
                run = await bench_point(be, make_workload(spec), concurrency=c, request_rate=None,
                                        slo_ms={"ttft": 2000, "tpot": 200}, desc=f"{model} c={c}")
                out[model].append(run)
                s = run["summary"]
                rows.append(f"| {model} | {c} | {s['request_throughput']:.2f} | {s['output_throughput']:.0f} | "
                            f"{s['goodput']:.2f} | {s['ttft_ms']['p50']:.0f} / {s['ttft_ms']['p99']:.0f} | "
                            f"{s['tpot_ms']['p50']:.1f} / {s['tpot_ms']['p99']:.1f} | "
                            f"{s['itl_ms']['p50']:.1f} / {s['itl_ms']['p99']:.1f} | "
                            f"{s['e2el_ms']['p50'] / 1000:.2f} / {s['e2el_ms']['p99'] / 1000:.2f} |")
    table = "\n".join([
        "| model | streams | req/s | output tok/s | goodput req/s (TTFT ≤ 2 s, TPOT ≤ 200 ms) "
        "| TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms | E2E p50 / p99 s |",
        "|---|---|---|---|---|---|---|---|---|", *rows])
    from load.plots import plot_series

    plot_series(out, IMG / "concurrency.png", title="Full stack (OpenAI shim, streaming) against concurrency")
    return table, out


# --- cancel storm --------------------------------------------------------------------------------

async def _kv_timeline(be: Backend, stop: asyncio.Event, t0: float, samples: list) -> None:
    while not stop.is_set():
        kv = await be.kv_usage()
        samples.append((time.perf_counter() - t0, kv or 0.0))
        await asyncio.sleep(0.05)


async def suite_cancel(args) -> tuple[str, dict]:
    import httpx

    spec = WorkloadSpec("cancel-storm", num_jobs=64, input_len=128, output_len=512, range_ratio=0.5,
                        cancel_after=(1, 8))
    out, rows, timelines = {}, [], {}
    for model in args.models:
        out[model] = {}
        opts = engine_options(model, args.engine_option)
        with Stack(resolve_model(model), opts, shim=True) as stack:
            for kind in ("http", "grpc"):
                be = (ShimBackend(stack.shim_url, metrics_url=stack.metrics_url) if kind == "http"
                      else GrpcBackend(stack.grpc_url, metrics_url=stack.metrics_url))
                await be.start()
                await warm_up(be, 4)
                hist0 = histogram_buckets(httpx.get(stack.metrics_url).text, "llm_abort_to_free_seconds")
                samples: list = []
                stop = asyncio.Event()
                t0 = time.perf_counter()
                poller = asyncio.create_task(_kv_timeline(be, stop, t0, samples))
                run = await bench_point(be, make_workload(spec), concurrency=64, request_rate=None,
                                        check_idle=True, desc=f"{model} cancel {kind}")
                run["storm_end_s"] = max(r["start"] + r["latency"] for r in run["records"])
                await asyncio.sleep(0.5)
                stop.set()
                await poller
                hist1 = histogram_buckets(httpx.get(stack.metrics_url).text, "llm_abort_to_free_seconds")
                run["abort_to_free_ms"] = {f"p{int(q * 100)}": (v * 1000 if (v := bucket_quantile(q, hist0, hist1))
                                                               is not None else None) for q in (0.5, 0.99)}
                run["kv_timeline"] = samples
                await be.close()
                out[model][kind] = run
                timelines[f"{model} {kind}"] = samples
                s, kv = run["summary"], run["summary"]["kv"]
                failed = f" ({s['failed']} failed)" if s["failed"] else ""
                rows.append(f"| {model} | {kind} | {s['cancelled']}{failed} | "
                            f"{s['work'].get('num_aborted', 0):.0f} | {max(v for _, v in samples):.1%} | "
                            f"{kv['kv_idle']:.1%} | {_fmt(kv['kv_final'], '.1%')} | "
                            f"{_fmt(kv['kv_back_to_idle_s'], '.2f')} | "
                            f"{_fmt(run['abort_to_free_ms']['p50'], '.1f')} / {_fmt(run['abort_to_free_ms']['p99'], '.1f')} |")
    table = "\n".join([
        "| model | via | cancelled (of 64) | engine aborts | peak KV | idle KV before | KV after | "
        "back to idle after (s) | cancel-to-free p50 / p99 ms |",
        "|---|---|---|---|---|---|---|---|---|", *rows])
    _plot_timelines(timelines, IMG / "cancel_storm.png")
    return table, out


def _plot_timelines(timelines: dict, path) -> None:
    from load.plots import _save, plt

    fig, ax = plt.subplots(figsize=(8, 3.8))
    for label, samples in timelines.items():
        ax.plot([t for t, _ in samples], [v * 100 for _, v in samples], drawstyle="steps-post", label=label)
    ax.set_xlabel("time since the storm began (s)")
    ax.set_ylabel("KV cache usage (%)")
    ax.set_title("64 streams cancelled after 1-8 tokens: KV usage back to idle")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


# --- Locust ----------------------------------------------------------------------------------------

async def suite_locust(args) -> tuple[str, dict]:
    """Both Locust users against the full stack for --seconds; the CSV stats as a table."""
    import csv
    import subprocess

    out, rows = {}, []
    for model in args.models:
        with Stack(resolve_model(model), engine_options(model, args.engine_option), shim=True) as stack:
            prefix = RESULTS / f"locust-{model}"
            cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "load" / "locustfile.py"), "--headless",
                   "-u", str(args.users), "-r", str(args.users), "-t", f"{args.seconds}s", "--stop-timeout", "60",
                   "--only-summary", "--host", stack.shim_url.removesuffix("/v1"),
                   "--triton-grpc", stack.grpc_url, "--max-tokens", "64", "--prompt-tokens", "128",
                   "--csv", str(prefix)]
            await asyncio.to_thread(subprocess.run, cmd, cwd=ROOT, capture_output=True, timeout=args.seconds + 180)
        with open(f"{prefix}_stats.csv") as f:
            stats = [r for r in csv.DictReader(f) if r["Name"] != "/v1/models"]
        out[model] = stats
        for r in stats:
            rows.append(f"| {model} | {r['Type'] or 'all'} | {r['Name']} | {r['Request Count']} | {r['Failure Count']} "
                        f"| {r['50%']} | {r['90%']} | {r['99%']} | {float(r['Requests/s']):.1f} |")
    table = "\n".join([
        f"Locust, {args.users} users (half OpenAI shim SSE, half Triton gRPC stream), {args.seconds} s, "
        "64 output tokens per request:", "",
        "| model | type | entry | count | failures | p50 ms | p90 ms | p99 ms | per s |",
        "|---|---|---|---|---|---|---|---|---|", *rows])
    return table, out


async def suite_peers(args) -> tuple[str, dict]:
    from load.peers import suite_peers as run

    return await run(args, bench_point, IMG)


SUITES = {"overhead": suite_overhead, "prefix": suite_prefix, "concurrency": suite_concurrency,
          "cancel": suite_cancel, "locust": suite_locust, "peers": suite_peers}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m load.suites", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=sorted(SUITES))
    p.add_argument("--models", nargs="+", default=None,
                   help="presets or checkpoint dirs (default bench-15m bench-110m; peers: models/default bench-110m)")
    p.add_argument("--scale", type=float, default=1.0, help="fraction of the default request counts")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], help="concurrency sweep")
    p.add_argument("--users", type=int, default=16, help="locust: concurrent users")
    p.add_argument("--seconds", type=int, default=60, help="locust: run time")
    add_peer_arguments(p)
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    if args.models is None:
        args.models = ["models/default", "bench-110m"] if args.suite == "peers" else ["bench-15m", "bench-110m"]
    command = "python -m load.suites " + " ".join(sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()
    table, data = asyncio.run(SUITES[args.suite](args))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"suite-{args.suite}.json").write_text(json.dumps(json_safe(
        {"command": command, "seconds": time.perf_counter() - t0, "results": data}), indent=1))
    (RESULTS / f"suite-{args.suite}.md").write_text(f"`{command}`\n\n{table}\n")
    print(f"\n`{command}`  ({time.perf_counter() - t0:.0f} s)\n\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
