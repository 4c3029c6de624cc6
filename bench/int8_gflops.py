"""GFLOP/s of one GEMM per core (issue 28): the int8 kernels against fp32 and bf16 on one thread.

    python -m bench.int8_gflops [--ms 1 4 16 32 64 256] [--shapes 960x576 3072x576 576x1536 49152x576] [--rounds 5]
                                [--march x86-64-v3]

For SmolLM2-135M's projection shapes (N x K: qkv, gate_up, down, the LM head) and each row count M,
best of ``--rounds`` (CPU time of the calling thread, so a loaded host's other processes matter
less), one thread: ``torch fp32`` / ``torch bf16`` (F.linear, oneDNN / MKL), ``ours fp32``
(kernels/csrc linear_f32, the fused step's fp32 tiles), ``int8 rows`` (groups of 32 on the
row-major layout: csrc/w8_avx512.c, or w8_a16.c on AVX2 builds) and ``int8 packed`` (the layout
packed at load, csrc/w8_packed.c; at M < PACKED_MIN_M w8_gemm reads the row-major copy). GFLOP/s =
2 M N K / seconds. ``--march`` builds the quant library for another CPU level (``x86-64-v3``: the
AVX2 kernels, as on a host without AVX-512) and measures those.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from backend.quant import cpu, layout


def best_s(fn, rounds: int, min_s: float = 0.02) -> float:
    fn()
    calls = 1
    t0 = time.thread_time()
    fn()
    one = max(time.thread_time() - t0, 1e-6)
    calls = max(1, int(min_s / one))
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - t0) / calls)
    return best


def variants(x: torch.Tensor, w: torch.Tensor, q, packed) -> dict:
    from kernels.cpu import decode_library

    m, k = x.shape
    n = w.shape[0]
    xb, wb = x.bfloat16(), w.bfloat16()
    y = torch.empty(m, n)
    out = {"torch fp32": lambda: F.linear(x, w), "torch bf16": lambda: F.linear(xb, wb)}
    dec = decode_library()
    if dec is not None:
        out["ours fp32"] = lambda: dec.linear_f32(x.data_ptr(), m, k, w.data_ptr(), None, n, y.data_ptr(), 0, 1)
    rows = "z" if cpu.library().w8_has_avx512() else "c"
    out["int8 rows"] = lambda: cpu.gemm(x, "int8", q.qweight, q.scales, None, 32, k, None, kernel=rows)
    if packed is not None:
        out["int8 packed"] = lambda: cpu.gemm(x, "int8", q.qweight, q.scales, None, 32, k, None, packed=packed)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", nargs="+", type=int, default=[1, 4, 16, 32, 64, 256])
    ap.add_argument("--shapes", nargs="+", default=["960x576", "3072x576", "576x1536", "49152x576"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--march", default=None, help="build the quant library with -march=THIS (default: native)")
    a = ap.parse_args(argv)
    if a.march:
        cpu.FLAGS = [f"-march={a.march}" if f.startswith("-march=") else f for f in cpu.FLAGS]
        cpu.library.cache_clear()
    torch.set_num_threads(1)
    header = None
    for shape in a.shapes:
        n, k = (int(v) for v in shape.split("x"))
        w = torch.randn(n, k) * 0.05
        q = layout.quantize_int8(w, 32)
        packed = cpu.pack("int8", q.qweight, q.scales, 32, k)
        for m in a.ms:
            x = torch.randn(m, k)
            fns = variants(x, w, q, packed)
            if header is None:
                header = list(fns)
                print("| N x K | M | " + " | ".join(header) + " |  (GFLOP/s, 1 thread)\n|---|---|" + "---|" * len(header))
            r = {name: 2 * m * n * k / best_s(fn, a.rounds) / 1e9 for name, fn in fns.items()}
            print(f"| {shape} | {m} | " + " | ".join(f"{r[h]:.1f}" for h in header) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
