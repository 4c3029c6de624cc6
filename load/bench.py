"""Serving benchmark in the style of vLLM's ``benchmark_serving``.

    # the full stack (tritonserver + shim started here), a concurrency sweep over HTTP
    python -m load.bench --backend http --start-stack --model bench-15m --workload mixed \
        --concurrency 1 4 16 64 --num-requests 128 --slo ttft=1000 tpot=100 --plot

    # a running server: the shim, or the ensemble over gRPC; Poisson arrivals
    python -m load.bench --backend http --url http://127.0.0.1:9000 --metrics-url http://127.0.0.1:8002/metrics ...
    python -m load.bench --backend grpc --url 127.0.0.1:8001 --request-rate 2 4 8 ...

    # the engine in this process (no server): the serving overhead's baseline
    python -m load.bench --backend engine --model bench-15m --concurrency 32 ...

Writes one JSON (config, one entry per load point: summary, work counters, per-request records)
under load/results/ and, with --plot, a PNG beside it.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import pathlib
import sys
import time

from load.backends import Backend, EngineBackend, GrpcBackend, ShimBackend
from load.counters import work_delta
from load.runner import run_jobs
from load.stack import ROOT, Stack, engine_options, resolve_model
from load.summary import format_summary, json_safe, summarize
from load.workloads import WORKLOADS, Turn, Job, WorkloadSpec, make_workload

RESULTS = ROOT / "load" / "results"


def parse_slo(items: list[str] | None) -> dict[str, float]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"SLO {item!r}: use ttft=MS, tpot=MS or e2el=MS")
        out[key] = float(value)
    return out


async def wait_kv_idle(backend: Backend, idle: float, timeout: float = 30.0) -> dict:
    """Poll KV usage until it is back to ``idle``; how long that took (None: it never did)."""
    t0 = time.perf_counter()
    first = await backend.kv_usage()
    value = first
    while value is not None and value > idle + 1e-9 and time.perf_counter() - t0 < timeout:
        await asyncio.sleep(0.1)
        value = await backend.kv_usage()
    ok = value is not None and value <= idle + 1e-9
    return {"kv_idle": idle, "kv_at_end": first, "kv_final": value,
            "kv_back_to_idle_s": (time.perf_counter() - t0) if ok else None}


async def settled_counters(backend: Backend, timeout: float = 10.0) -> dict[str, float]:
    """Counters once nothing is running or waiting (gauges are published after each step, so a
    read right after the last response can still see it running)."""
    t0 = time.perf_counter()
    while True:
        c = await backend.counters()
        if not c or (c.get("num_running", 0) == 0 and c.get("num_waiting", 0) == 0) \
                or time.perf_counter() - t0 > timeout:
            return c
        await asyncio.sleep(0.05)


async def bench_point(backend: Backend, jobs: list[Job], *, concurrency: int | None,
                      request_rate: float | None, seed: int = 0, slo_ms: dict | None = None,
                      check_idle: bool = False, progress: bool = True, desc: str = "") -> dict:
    """One load point: counters before, the run, counters after (and the KV idle check)."""
    before = await settled_counters(backend)
    records, duration = await run_jobs(backend, jobs, concurrency=concurrency, request_rate=request_rate,
                                       seed=seed, progress=progress, desc=desc)
    summary = summarize(records, duration, slo_ms)
    if check_idle:
        summary["kv"] = await wait_kv_idle(backend, before.get("kv_usage", 0.0))
    after = await settled_counters(backend)
    summary["work"] = work_delta(before, after) if after else {}
    return {"concurrency": concurrency, "request_rate": request_rate, "summary": summary,
            "records": [r.to_json() for r in records]}


async def warm_up(backend: Backend, n: int) -> None:
    """A few short requests so one-time costs (first compile, allocator growth) stay out."""
    if n <= 0:
        return
    jobs = [Job(f"warmup-{i}", [Turn(f"warm up {i}", 8)]) for i in range(n)]
    await run_jobs(backend, jobs, concurrency=n, progress=False)


def make_backend(args, stack: Stack | None) -> Backend:
    if args.backend == "engine":
        return EngineBackend(resolve_model(args.model), engine_options(args.model, args.engine_option))
    metrics = args.metrics_url or (stack.metrics_url if stack else None)
    if args.backend == "http":
        return ShimBackend(args.url or stack.shim_url, api_key=args.api_key, metrics_url=metrics)
    return GrpcBackend(args.url or stack.grpc_url, metrics_url=metrics)


def workload_spec(args) -> WorkloadSpec:
    return WorkloadSpec(name=args.workload, num_jobs=args.num_requests, seed=args.seed,
                        input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
                        num_groups=args.num_groups, prefix_len=args.prefix_len, turns=args.turns,
                        history_len=args.history_len, followup_len=args.followup_len)


async def run_benchmark(args) -> dict:
    spec = workload_spec(args)
    jobs = make_workload(spec)
    slo = parse_slo(args.slo)
    points = [("concurrency", c) for c in args.concurrency or []] + \
             [("request_rate", r) for r in args.request_rate or []]
    if not points:
        raise ValueError("give --concurrency and/or --request-rate")
    with contextlib.ExitStack() as ctx:
        stack = None
        if args.start_stack:
            if args.backend == "engine":
                raise ValueError("--start-stack is for the http and grpc backends")
            stack = ctx.enter_context(Stack(resolve_model(args.model), engine_options(args.model, args.engine_option),
                                            shim=args.backend == "http"))
        elif args.backend != "engine" and not args.url:
            raise ValueError("give --url of a running server, or --start-stack")
        backend = make_backend(args, stack)
        await backend.start()
        try:
            await warm_up(backend, args.warmup)
            runs = []
            for kind, value in points:
                conc = value if kind == "concurrency" else args.max_concurrency
                rate = value if kind == "request_rate" else None
                desc = f"{args.backend} {args.workload} {kind}={value}"
                run = await bench_point(backend, jobs, concurrency=conc, request_rate=rate, seed=args.seed,
                                        slo_ms=slo, check_idle=args.workload == "cancel-storm",
                                        progress=not args.no_progress, desc=desc)
                print(format_summary(run["summary"], desc), flush=True)
                runs.append(run)
        finally:
            await backend.close()
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config["model_dir"] = str(resolve_model(args.model)) if args.model else None
    config["command"] = "python -m load.bench " + " ".join(sys.argv[1:])
    return {"config": config, "workload": vars(spec), "runs": runs}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m load.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["http", "grpc", "engine"], default="http")
    p.add_argument("--url", help="shim base URL (http) or Triton gRPC host:port (grpc)")
    p.add_argument("--api-key")
    p.add_argument("--metrics-url", help="Triton metrics endpoint for work counters")
    p.add_argument("--start-stack", action="store_true", help="start tritonserver (+ shim) here")
    p.add_argument("--model", default="bench-15m", help="preset or checkpoint directory")
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="mixed")
    w.add_argument("--num-requests", type=int, default=64, help="jobs (conversations for multi-turn)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--input-len", type=int, default=128)
    w.add_argument("--output-len", type=int, default=128)
    w.add_argument("--range-ratio", type=float, default=0.5)
    w.add_argument("--num-groups", type=int, default=4)
    w.add_argument("--prefix-len", type=int, default=512)
    w.add_argument("--turns", type=int, default=4)
    w.add_argument("--history-len", type=int, default=1024)
    w.add_argument("--followup-len", type=int, default=32)
    ld = p.add_argument_group("load")
    ld.add_argument("--concurrency", type=int, nargs="*", help="fixed concurrency levels (a sweep)")
    ld.add_argument("--request-rate", type=float, nargs="*", help="Poisson rates in req/s (inf = burst)")
    ld.add_argument("--max-concurrency", type=int, help="cap on streams in flight with --request-rate")
    ld.add_argument("--slo", nargs="*", metavar="KEY=MS", help="goodput SLOs: ttft=, tpot=, e2el=")
    ld.add_argument("--warmup", type=int, default=2)
    out = p.add_argument_group("output")
    out.add_argument("--out", help="JSON path (default load/results/<backend>-<workload>-<time>.json)")
    out.add_argument("--plot", action="store_true", help="PNG of the sweep beside the JSON")
    out.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = asyncio.run(run_benchmark(args))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    path = pathlib.Path(args.out) if args.out else \
        RESULTS / f"{args.backend}-{args.workload}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(result), indent=1))
    print(f"wrote {path}")
    if args.plot:
        from load.plots import plot_sweep

        png = plot_sweep(result, path.with_suffix(".png"))
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
