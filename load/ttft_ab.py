"""Time to first token at 1 stream through the OpenAI shim, several checkouts side by side.

    python -m load.ttft_ab /tmp/before /work/main [--model bench-15m] [--prompts 40] [--max-tokens 16]

Every tree's stack (``load.overhead_ab.TreeStack``: tritonserver + shim of that checkout) is up for
the whole run and the requests alternate between them (order reversed every other prompt), so
background load hits every tree alike. Prompts of 16-256 random tokens are sent once to every stack
first (cold: fills the prefix caches), then twice more measured: the measured requests are
prefix-cache hits, so TTFT is the stack's own path plus a one-block prefill step, as in the
1-stream phase of ``load.suites peers`` after its 16-stream phase. Prints TTFT p50 / p90 and the
time between SSE chunks (ITL p50) per tree. For where the time goes hop by hop, run a stack with
``LLM_TTFT_TRACE=<dir>`` on the interpreter of ``python -m bench.lab_venv`` (bench/ttft_trace.py).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time

import numpy as np

from load.overhead_ab import TreeStack
from load.stack import engine_options, resolve_model


async def run(args) -> str:
    import httpx
    from transformers import AutoTokenizer

    model = resolve_model(args.model)
    opts = engine_options(args.model, ["num_threads=1"] + args.engine_option)
    tok = AutoTokenizer.from_pretrained(str(model))
    rng = np.random.default_rng(args.seed)
    prompts = [tok.decode(rng.integers(100, min(1000, tok.vocab_size), size=int(rng.integers(16, 256))).tolist())
               for _ in range(args.prompts)]
    with contextlib.ExitStack() as es:
        stacks = [es.enter_context(TreeStack(t, str(model), opts, True)) for t in args.trees]
        async with httpx.AsyncClient(timeout=120) as http:
            names = [(await http.get(s.shim_url + "/models")).json()["data"][0]["id"] for s in stacks]

            async def one(i: int, text: str) -> tuple[float, list[float]]:
                body = {"model": names[i], "prompt": text, "max_tokens": args.max_tokens, "stream": True,
                        "ignore_eos": True}
                t0 = time.perf_counter()
                first, last, gaps = None, None, []
                async with http.stream("POST", stacks[i].shim_url + "/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            now = time.perf_counter()
                            if first is None:
                                first = now - t0
                            else:
                                gaps.append(now - last)
                            last = now
                return first, gaps

            for p in prompts:                       # cold pass
                for i in range(len(stacks)):
                    await one(i, p)
            ttft = {t: [] for t in args.trees}
            itl = {t: [] for t in args.trees}
            for rnd in range(2):
                for k, p in enumerate(prompts):
                    order = list(range(len(stacks)))
                    if (k + rnd) % 2:
                        order.reverse()
                    for i in order:
                        f, g = await one(i, p)
                        ttft[args.trees[i]].append(f)
                        itl[args.trees[i]].extend(g)
    lines = [f"`python -m load.ttft_ab {' '.join(sys.argv[1:])}`", "",
             "| tree | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | requests |", "|---|---|---|---|---|"]
    for t in args.trees:
        f = sorted(ttft[t])
        lines.append(f"| {t} | {statistics.median(f) * 1e3:.2f} | {f[int(0.9 * len(f))] * 1e3:.2f} | "
                     f"{statistics.median(itl[t]) * 1e3:.2f} | {len(f)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m load.ttft_ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trees", nargs="+", help="checkouts to serve from (see load.overhead_ab NAME@tree=DIR)")
    p.add_argument("--model", default="bench-15m")
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    print(asyncio.run(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
