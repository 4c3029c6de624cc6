"""Memory read bandwidth of this host, and what it allows a 1-stream decode (issue 28's yardstick).

    PYTHONPATH=. .venv/bin/python -m load.bandwidth [--gib 1] [--threads 1 2] [--models bench-110m models/default]

Probe: the sum of a ``--gib`` GiB fp32 torch tensor (far beyond the last-level cache), best of
``--reps`` after one warm-up, with 1 thread and with every core (``torch.set_num_threads``); bytes
read / seconds, printed in GB/s (1e9 bytes). That is one sequential stream per thread; a core can
read more with several streams side by side, as the fused step's tiles do (4 weight rows from 4
parts of the matrix), so a second column, "gemv GB/s", times the fused step's own fp32 GEMV
(``linear_f32`` at M = 1) over a matrix of the same size: the most a decode's weight reads get.

A decode at 1 stream reads each weight matrix once per token, so per model it prints the weight
bytes of one decode token in fp32 and bf16 (every linear and the lm_head; the embedding table only
where it is the lm_head too, tied: a decode reads one row of it otherwise) and the tok/s that the
best bandwidth of both probes would allow. A measured tok/s x bytes per token / bandwidth is the
share of the limit a decode reaches (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

import torch

from load.stack import resolve_model


def read_gbps(threads: int, gib: float = 1.0, reps: int = 5) -> float:
    """GB/s of summing a ``gib`` GiB fp32 tensor on ``threads`` threads (best of ``reps``)."""
    n = int(gib * (1 << 30)) // 4
    buf = torch.ones(n, dtype=torch.float32)            # written once: every page is real memory
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf.sum()                                         # warm-up
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            total = buf.sum().item()
            best = min(best, time.perf_counter() - t0)
        assert total == n                                 # the whole buffer was read
    finally:
        torch.set_num_threads(saved)
    return n * 4 / best / 1e9


def gemv_gbps(threads: int, gib: float = 1.0, reps: int = 5) -> float | None:
    """GB/s of the fused step's fp32 GEMV (1 x K times a ``gib`` GiB [N, K] matrix), or None
    without the C library."""
    from kernels.cpu import decode_library

    lib = decode_library()
    if lib is None:
        return None
    k = 1024
    n = int(gib * (1 << 30)) // 4 // k
    w, x, y = torch.ones(n, k), torch.ones(1, k), torch.empty(1, n)
    best = float("inf")
    for rep in range(reps + 1):                           # the first is a warm-up
        t0 = time.perf_counter()
        lib.linear_f32(x.data_ptr(), 1, k, w.data_ptr(), None, n, y.data_ptr(), 0, threads)
        if rep:
            best = min(best, time.perf_counter() - t0)
    assert y.min().item() == k                            # every row was read
    return n * k * 4 / best / 1e9


def decode_weight_elems(model_dir: pathlib.Path) -> int:
    """Weight elements a decode token reads: every 2-D tensor but an untied embedding table."""
    from safetensors import safe_open

    cfg = json.loads((model_dir / "config.json").read_text())
    tied = cfg.get("tie_word_embeddings", False)
    total = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():                           # noqa: SIM118 (a safe_open handle, no __iter__)
                shape = st.get_slice(name).get_shape()
                if len(shape) != 2 or (name.endswith("embed_tokens.weight") and not tied):
                    continue                                  # norms (small), an untied embedding
                total += shape[0] * shape[1]
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}))
    ap.add_argument("--models", nargs="*", default=[])
    a = ap.parse_args()
    best = 0.0
    for t in a.threads:
        gbps, gemv = read_gbps(t, a.gib, a.reps), gemv_gbps(t, a.gib, a.reps)
        best = max(best, gbps, gemv or 0.0)
        print(json.dumps({"threads": t, "read GB/s": round(gbps, 1), "gemv GB/s": gemv and round(gemv, 1)}), flush=True)
    for name in a.models:
        elems = decode_weight_elems(resolve_model(name))
        row = {"model": name, "weights per token (M)": round(elems / 1e6, 1), "at GB/s": round(best, 1)}
        for dtype, size in (("fp32", 4), ("bf16", 2)):
            row[f"{dtype} MB/token"] = round(elems * size / 1e6, 1)
            row[f"{dtype} tok/s ceiling"] = round(best * 1e9 / (elems * size), 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
