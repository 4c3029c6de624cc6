"""Served int8 against fp32 at 16 (and 1) streams (issue 28: int8 >= fp32 at 16 streams, served).

    PYTHONPATH=. .venv/bin/python -m bench.int8_served [--model models/default] [--streams 16 1] [--scale 0.5]

Our full stack as ``load.suites peers`` runs it (``load.stack.Stack`` through the OpenAI shim,
``load.stack.engine_options``, all cores), once in fp32 and once with ``quantization=int8`` (the
default groups of 32; ``--engine-option quant_group_size=0``: per channel), each on the peers suite's workload
(``load.peers.peer_spec``: prompts 16-256 tokens, outputs mean 64, greedy, ``ignore_eos``; 64
requests at 16 streams and 16 at 1, times ``--scale``) after 4 warm-up requests. One JSON row per
stream count: output tok/s per variant and ``int8/fp32``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os

from load.backends import CompletionsBackend
from load.bench import bench_point, warm_up
from load.peers import peer_spec
from load.stack import Stack, engine_options, resolve_model
from load.workloads import make_workload


async def served(model_dir, opts: dict, streams: list[int], scale: float, label: str) -> dict:
    out = {}
    with Stack(model_dir, opts, shim=True) as stack:
        be = CompletionsBackend(stack.shim_url, label="ours", metrics_url=stack.metrics_url)
        await be.start()
        try:
            await warm_up(be, 4)
            for s in streams:
                run = await bench_point(be, make_workload(peer_spec(s, scale)), concurrency=s, request_rate=None,
                                        desc=f"{label} c={s}")
                summ = run["summary"]
                if summ["failed"]:
                    raise RuntimeError(f"{label} c={s}: {summ['failed']} requests failed: {summ['errors']}")
                out[s] = summ["output_throughput"]
        finally:
            await be.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/default")
    p.add_argument("--streams", type=int, nargs="+", default=[16, 1])
    p.add_argument("--scale", type=float, default=1.0, help="fraction of the peers suite's request counts")
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args(argv)
    model_dir = resolve_model(a.model)
    base = {**engine_options(str(model_dir), a.engine_option), "dtype": "float32"}
    print(json.dumps({"loadavg": os.getloadavg()}), flush=True)
    fp32 = asyncio.run(served(model_dir, base, a.streams, a.scale, "fp32"))
    int8 = asyncio.run(served(model_dir, {**base, "quantization": "int8"}, a.streams, a.scale, "int8"))
    for s in a.streams:
        print(json.dumps({"streams": s, "fp32 tok/s": round(fp32[s], 1), "int8 tok/s": round(int8[s], 1),
                          "int8/fp32": round(int8[s] / fp32[s], 2)}), flush=True)
    print(json.dumps({"loadavg_end": os.getloadavg()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
