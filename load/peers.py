"""``python -m load.suites peers``: our full stack against llama.cpp's ``llama-server``, same checkpoint,
same dtype, same workload, one after the other in one invocation.

Workload (seeded, identical for both): prompts uniform in 16-256 tokens, outputs exponential with
mean 64 capped at 256, greedy, ``ignore_eos``; /v1/completions streamed (both servers speak it; no
chat template, which they would render differently). 64 requests at 16 streams, 16 at 1 stream
(times ``--scale``). llama.cpp runs ``-np`` = the largest stream count, ``-t`` = all cores (or
``--peer-threads``; give ours the same with ``--engine-option num_threads=N``),
continuous batching, its KV cache as ``--peer-cache-type`` says (default: its own default, f16;
``same`` = the weights' dtype, which made it much slower at 16 streams here: docs/benchmarks.md); ours is the
launcher's stack through the OpenAI shim with ``load/stack.py``'s
options for the preset and ``dtype`` set to the run's.

Quantized (``--dtypes q8_0 q4_0``): llama.cpp serves the f32 GGUF quantized by its own
``llama-quantize`` (default recipe); ours serves the same file imported ``--keep-quantized``
(``--ours-quant gguf``: the same weights on both sides, int8 / int4 with group 32) or our own
``quantization=int8`` (per channel) / ``int4`` of the float checkpoint (``--ours-quant option``).
Activations and KV are fp32 on our side, llama.cpp's KV is its default (f16).

Output tok/s counts requested (= generated, with ignore_eos) tokens over the point's wall time.
"""
from __future__ import annotations

import os
import pathlib

from load.backends import CompletionsBackend
from load.bench import warm_up
from load.stack import Stack, engine_options, resolve_model
from load.workloads import WorkloadSpec, make_workload

PEER, OURS = "llama.cpp", "ours"


def peer_spec(streams: int, scale: float, seed: int = 0) -> WorkloadSpec:
    n = max(4, round((64 if streams > 1 else 16) * scale))
    return WorkloadSpec("mixed", num_jobs=n, seed=seed, input_len=136, range_ratio=120 / 136,
                        output_len=64, output_dist="exponential", output_cap=256)


async def _points(be: CompletionsBackend, model: str, dtype: str, streams: list[int], scale: float,
                  bench_point) -> dict:
    await be.start()
    try:
        await warm_up(be, 4)
        out = {}
        for s in streams:
            out[s] = await bench_point(be, make_workload(peer_spec(s, scale)), concurrency=s, request_rate=None,
                                       desc=f"{model} {dtype} {be.name} c={s}")
        return out
    finally:
        await be.close()


def machine() -> dict:
    """What the numbers were measured on (the JSON keeps it beside the results)."""
    from backend.model.loader import cpu_flags

    model = next((line.partition(":")[2].strip() for line in open("/proc/cpuinfo")
                  if line.startswith("model name")), "?")
    flags = cpu_flags()
    return {"cpu": model, "cores": os.cpu_count(), "loadavg": os.getloadavg(),
            "isa": [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]}


async def run_peers(args, bench_point) -> dict:
    """{"machine": {...}, model: {dtype: {"llama.cpp" | "ours": {streams: bench_point result}}}}"""
    from load.llamacpp import (QUANT_METHODS, QUANT_TYPES, LlamaServer, convert_to_gguf, ensure_llama_server,
                               import_ours, quantize_gguf)

    if PEER in args.contenders:
        ensure_llama_server()
    out: dict = {"machine": machine()}
    for model in args.models:
        model_dir = resolve_model(model)
        name = pathlib.Path(model).name
        out[name] = {}
        for dtype in args.dtypes:
            res = out[name][dtype] = {}
            quant = dtype in QUANT_TYPES
            ours_dir, opts = model_dir, {**engine_options(model, args.engine_option), "dtype": dtype}
            if quant:
                gguf = quantize_gguf(model_dir, dtype)
                opts["dtype"] = "float32"
                if getattr(args, "ours_quant", "gguf") == "gguf":
                    ours_dir = import_ours(gguf)
                else:
                    opts["quantization"] = QUANT_METHODS[dtype]
                res["weights"] = quant_weights(gguf, ours_dir, opts)
            if PEER in args.contenders:
                gguf = gguf if quant else convert_to_gguf(model_dir, dtype)
                with LlamaServer(gguf, parallel=max(args.streams), dtype="float32" if quant else dtype,
                                 threads=args.peer_threads, cache_type=args.peer_cache_type) as srv:
                    res[PEER] = await _points(CompletionsBackend(srv.url, label=PEER), name, dtype, args.streams,
                                              args.scale, bench_point)
            if OURS in args.contenders:
                with Stack(ours_dir, opts, shim=True) as stack:
                    be = CompletionsBackend(stack.shim_url, label=OURS, metrics_url=stack.metrics_url)
                    res[OURS] = await _points(be, name, dtype, args.streams, args.scale, bench_point)
    out["machine"]["loadavg_end"] = os.getloadavg()
    return out


def quant_weights(gguf: pathlib.Path, ours_dir: pathlib.Path, opts: dict) -> dict:
    """What each side holds: llama.cpp's file size (mmapped as it is) and our resident weight bytes."""
    import torch

    from backend.quant.plan import planned_summary

    s = planned_summary(ours_dir, dtype=torch.float32, quantization=opts.get("quantization", "none"),
                        group_size=int(opts.get("quant_group_size", 32)),
                        lm_head=str(opts.get("quant_lm_head", "")).lower() in ("1", "true", "yes", "on"))
    return {"gguf_file_bytes": gguf.stat().st_size, "ours_weight_bytes": s["weight_bytes"],
            "ours_method": s["method"], "ours_group_size": s["group_size"], "ours_dir": str(ours_dir)}


def _v(summary: dict | None, key: str, spec: str) -> str:
    if summary is None:
        return "–"
    x = summary[key]
    return format(x["p50"] if isinstance(x, dict) else x, spec)


def peers_table(out: dict) -> str:
    rows = []
    for model, by_dtype in out.items():
        if model == "machine":
            continue
        for dtype, res in by_dtype.items():
            for s in res.get(PEER) or res[OURS]:           # (res["weights"]: quantized runs only)
                p, o = (res[k][s]["summary"] if k in res else None for k in (PEER, OURS))
                ratio = f"{o['output_throughput'] / p['output_throughput']:.2f}x" if p and o else "–"
                rows.append(f"| {model} | {dtype} | {s} | {_v(p, 'output_throughput', '.0f')} "
                            f"| {_v(o, 'output_throughput', '.0f')} | {ratio} "
                            f"| {_v(p, 'ttft_ms', '.0f')} / {_v(o, 'ttft_ms', '.0f')} "
                            f"| {_v(p, 'itl_ms', '.1f')} / {_v(o, 'itl_ms', '.1f')} |")
    return "\n".join(["| model | dtype | streams | llama.cpp tok/s | ours tok/s | ours / llama.cpp "
                      "| TTFT p50 ms llama.cpp / ours | ITL p50 ms llama.cpp / ours |",
                      "|---|---|---|---|---|---|---|---|", *rows])


async def suite_peers(args, bench_point, img: pathlib.Path) -> tuple[str, dict]:
    out = await run_peers(args, bench_point)
    from load.llamacpp import QUANT_TYPES
    from load.plots import plot_bars

    quant = any(d in QUANT_TYPES for d in args.dtypes)        # its own figure: the float one stays
    plot_bars({f"{m} {d} x{s}": {k: res[k][s]["summary"]["output_throughput"] for k in (PEER, OURS) if k in res}
               for m, by in out.items() if m != "machine" for d, res in by.items() for s in args.streams},
              img / ("peers-quant.png" if quant else "peers.png"), ylabel="output tokens/s",
              title="Full stack vs llama.cpp llama-server, same " + ("quantized GGUF" if quant else "checkpoint and dtype")
              + " (x = streams)")
    return peers_table(out), out
