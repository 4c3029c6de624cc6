"""Where dequantize + BLAS would beat the int8 C kernels on this host (issue 28): one GEMM per
shape and row count M, the kernels interleaved, CPU time of the calling thread, best of rounds.

    python -m bench.int8_crossover [--ms 1 2 4 16 64 256] [--shapes 576x576 1536x576 576x1536 192x576] [--threads 1]

Columns (µs per call): ``fp32`` (F.linear on the float weight, MKL), and for int8 in groups of 32
(the default): ``blas`` (dequantize + F.linear), ``a16`` (the AVX2 int16-activation tiles),
``z`` (csrc/w8_avx512.c, AVX-512BW hosts only), ``c`` (w8_gemm as routed); ``pc`` is w8_gemm on
the same weight per output channel. The last lines name, per shape, the smallest M at which
``blas`` was faster than the routed kernel (``c``): backend/quant/cpu.py routes groups of 32
above SMALL_M rows to BLAS only on hosts without AVX-512BW. Weights stay cache-resident between
calls (SmolLM2-135M's projection shapes), so this is each kernel's arithmetic rate.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from backend.quant import cpu, layout


def best_us(fns: dict, rounds: int, calls: int = 5) -> dict[str, float]:
    best = dict.fromkeys(fns, float("inf"))
    for fn in fns.values():
        fn()
    for _ in range(rounds):                 # variants interleaved: each sees the same host load
        for name, fn in fns.items():
            t0 = time.thread_time()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.thread_time() - t0) / calls * 1e6)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", nargs="+", type=int, default=[1, 2, 4, 16, 64, 256])
    ap.add_argument("--shapes", nargs="+", default=["576x576", "1536x576", "576x1536", "192x576"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    z = bool(cpu.library().w8_has_avx512())
    print("| N x K | M | fp32 | blas | a16 | " + ("z | " if z else "") + "c | pc | c vs fp32 |\n|---|" + "---|" * (7 + z))
    crossover = {}
    for shape in a.shapes:
        n, k = (int(v) for v in shape.split("x"))
        w = torch.randn(n, k)
        q32, qpc = layout.quantize_int8(w, 32), layout.quantize_int8(w)
        for m in a.ms:
            x = torch.randn(m, k)
            run = lambda q, kern: (lambda: cpu.gemm(x, "int8", q.qweight, q.scales, None, q.group_size, k,  # noqa: E731
                                                    None, kernel=kern))
            fns = {"fp32": lambda: F.linear(x, w), "blas": run(q32, "blas"), "a16": run(q32, "a16"),
                   **({"z": run(q32, "z")} if z else {}), "c": run(q32, "c"), "pc": run(qpc, "c")}
            r = best_us(fns, a.rounds)
            if r["blas"] < r["c"] and shape not in crossover:
                crossover[shape] = m
            print(f"| {shape} | {m} | " + " | ".join(f"{v:.0f}" for v in r.values()) + f" | {r['fp32'] / r['c']:.2f}x |",
                  flush=True)
    for shape in a.shapes:
        print(f"{shape}: dequantize + BLAS faster than the routed kernel from M = {crossover.get(shape, 'never (measured)')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
