"""Served 1-stream decode, bf16 against fp32, and against this host's read bandwidth (issue 28's goals).

    PYTHONPATH=. .venv/bin/python -m bench.served_dtype [--models models/default bench-110m] [--requests 16]

Per model, our full stack as ``load.suites peers`` runs it (``load.stack.Stack`` through the OpenAI
shim, ``load.stack.engine_options``, all cores) with ``dtype=float32``, then ``bfloat16``, each on
the peers suite's 1-stream workload (``load.peers.peer_spec``: prompts 16-256 tokens, outputs mean
64, greedy, ``ignore_eos``) after 4 warm-up requests. Then ``load.bandwidth``'s probes (a 1 GiB sum
and the fused fp32 GEMV, at every thread count of ``--threads``; the best) and each model's weight
bytes per decode token.

One JSON row per model: output tok/s (tokens over wall time, prompts included: the peers table's
figure) and decode tok/s (1000 / median TPOT: the decode alone) per dtype; ``bf16/fp32`` of each
(issue 28: >= 1.6 at 1 stream); and the decode's weight reads, decode tok/s x bytes per token, as a
share of the probe (>= 75 % in bf16).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os

from load.backends import CompletionsBackend
from load.bandwidth import decode_weight_elems, gemv_gbps, read_gbps
from load.bench import bench_point, warm_up
from load.peers import peer_spec
from load.stack import Stack, engine_options, resolve_model
from load.workloads import make_workload

BYTES = {"float32": 4, "bfloat16": 2}


async def served(model_dir, dtype: str, requests: int, extra: list[str]) -> dict:
    with Stack(model_dir, {**engine_options(str(model_dir), extra), "dtype": dtype}, shim=True) as stack:
        be = CompletionsBackend(stack.shim_url, label="ours", metrics_url=stack.metrics_url)
        await be.start()
        try:
            await warm_up(be, 4)
            run = await bench_point(be, make_workload(peer_spec(1, 1.0, single=requests)), concurrency=1,
                                    request_rate=None, desc=f"{model_dir.name} {dtype}")
        finally:
            await be.close()
    s = run["summary"]
    if s["failed"]:
        raise RuntimeError(f"{model_dir.name} {dtype}: {s['failed']} requests failed: {s['errors']}")
    return {"output tok/s": s["output_throughput"], "decode tok/s": 1000.0 / s["tpot_ms"]["p50"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["models/default", "bench-110m"])
    p.add_argument("--requests", type=int, default=16, help="requests per point (1 stream)")
    p.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}),
                   help="bandwidth probe thread counts (the best counts)")
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args(argv)
    gbps = max(max(read_gbps(t), gemv_gbps(t) or 0.0) for t in a.threads)
    print(json.dumps({"read bandwidth GB/s": round(gbps, 1), "loadavg": os.getloadavg()}), flush=True)
    for name in a.models:
        model_dir = resolve_model(name)
        elems = decode_weight_elems(model_dir)
        row: dict = {"model": name}
        for dtype in BYTES:
            r = asyncio.run(served(model_dir, dtype, a.requests, a.engine_option))
            row[dtype] = {k: round(v, 1) for k, v in r.items()}
            row[dtype]["% of bandwidth"] = round(100 * r["decode tok/s"] * elems * BYTES[dtype] / 1e9 / gbps, 1)
        for k in ("output tok/s", "decode tok/s"):
            row[f"bf16/fp32 {k}"] = round(row["bfloat16"][k] / row["float32"][k], 2)
        print(json.dumps(row), flush=True)
    print(json.dumps({"loadavg_end": os.getloadavg()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
