"""Per-step cost of a model in fp32 (fused C step) against bf16 on the torch path and bf16 on the fused
C step (AMX / VDPBF16PS, docs/kernels.md "bf16 models"), side by side in one process:

    .venv/bin/python -m bench.ab_dtype_step MODEL [--threads 1] [--reps 5]

MODEL: a checkpoint directory or a load/stack.py preset (bench-15m, bench-110m). Cases (block size
16, random tokens, contexts 64-192): decodes of 1, 4, 16 and 32 sequences, a 64-token prompt with
15 decodes, prompts of 136 and 512 tokens (``--only decode``: the cases whose name has that text);
the sides interleaved rep by rep.
Where the CPU has AVX512-BF16, a fourth side, "bf16 fused avx2", pins the fused step's AVX2 bf16
kernels (what an AVX2-only host runs). Prints best-of-``reps`` wall ms per side and the bf16
fused step's largest logit difference from the bf16 torch path (relative to the largest logit).
The decodes' "cached" context is never written, so that difference describes random K/V, not a
real prompt: tests/unit/test_model_fused_decode.py holds the accuracy checks.

``--amx-sweep``: instead, bf16 fused decodes of 2-16 sequences with AMX on and off, alternating
(``amx_set``; below ``AMX_MIN_M`` both sides run the VDPBF16PS tiles): where AMX starts to pay.
"""
from __future__ import annotations

import argparse
import json
import random
import time

from backend.config import EngineConfig
from backend.model.runner import SeqChunk, build_batch
from backend.model.runner import ModelRunner
from load.stack import resolve_model

BS = 16
BLOCKS = 1024


def make_batch(shape: list[tuple[int, int]], vocab: int, rng: random.Random):
    """(cached tokens, new tokens) per sequence -> a batch with block tables from one free list."""
    free, chunks = list(range(BLOCKS)), []
    for cached, new in shape:
        nb = -(-(cached + new) // BS)
        table, free = free[:nb], free[nb:]
        chunks.append(SeqChunk([rng.randrange(vocab) for _ in range(new)], cached, table))
    return build_batch(chunks, BS)


def amx_sweep(path: str, threads: int, reps: int, rng: random.Random) -> None:
    from kernels.cpu import decode_library

    lib = decode_library()
    r = ModelRunner(path, EngineConfig(block_size=BS, num_kv_blocks=BLOCKS, num_threads=threads, dtype="bfloat16"))
    if r.fused is None:
        raise SystemExit("no bf16 fused step here (needs AVX512-BF16)")
    try:
        for m in (2, 4, 6, 8, 10, 12, 16):
            batch = make_batch([(rng.randrange(64, 192), 1) for _ in range(m)], r.info.vocab_size, rng)
            best = {1: float("inf"), 0: float("inf")}
            for rep in range(reps + 1):                       # rep 0: warm-up
                for amx in ((1, 0) if rep % 2 else (0, 1)):
                    lib.amx_set(amx)
                    t0 = time.perf_counter()
                    r.execute(batch)
                    if rep:
                        best[amx] = min(best[amx], time.perf_counter() - t0)
            print(json.dumps({"decodes": m, "amx ms": round(best[1] * 1e3, 2), "vdpbf16ps ms": round(best[0] * 1e3, 2)}),
                  flush=True)
    finally:
        lib.amx_set(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--amx-sweep", action="store_true")
    ap.add_argument("--only", default="", help="run only the cases whose name contains this")
    a = ap.parse_args()
    path = str(resolve_model(a.model))
    rng = random.Random(0)
    if a.amx_sweep:
        amx_sweep(path, a.threads, a.reps, rng)
        return

    def runner(dtype: str) -> ModelRunner:
        return ModelRunner(path, EngineConfig(block_size=BS, num_kv_blocks=BLOCKS, num_threads=a.threads, dtype=dtype))

    r32, rb = runner("float32"), runner("bfloat16")
    fused_bf16 = rb.fused
    if r32.fused is None or fused_bf16 is None:
        raise SystemExit("the fused step is not available for this model or CPU (bf16 needs AVX512-BF16)")
    fused_bf16.max_tokens = 1 << 30
    sides = {"fp32 fused": r32.fused, "bf16 torch": None, "bf16 fused": fused_bf16}
    if rb.fused._lib.bf16_dot_supported():
        from backend.model.fused_decode import FusedDecoder

        sides["bf16 fused avx2"] = FusedDecoder(rb.model, rb.kv_caches, BS, rb.fused._lib, bf16_avx2=True)
        sides["bf16 fused avx2"].max_tokens = 1 << 30
    ctx = lambda: rng.randrange(64, 192)  # noqa: E731
    cases = [("decode 1", [(128, 1)]), ("decode 4", [(ctx(), 1) for _ in range(4)]),
             ("decode 16", [(ctx(), 1) for _ in range(16)]), ("decode 32", [(ctx(), 1) for _ in range(32)]),
             ("mixed 64+15", [(0, 64)] + [(ctx(), 1) for _ in range(15)]),
             ("prefill 136", [(0, 136)]), ("prefill 512", [(0, 512)])]
    for name, shape in [c for c in cases if a.only in c[0]]:
        batch = make_batch(shape, r32.info.vocab_size, rng)
        row, logits, times = {"case": name}, {}, {side: [] for side in sides}
        for _ in range(a.reps + 1):          # the first is a warm-up; sides interleaved, so a burst of
            for side, fused in sides.items():  # load on a shared host hits every side alike
                r = r32 if side.startswith("fp32") else rb
                if r is rb:
                    rb.fused = fused
                t0 = time.perf_counter()
                logits[side] = r.execute(batch)
                times[side].append(time.perf_counter() - t0)
        for side in sides:
            row[side] = round(min(times[side][1:]) * 1e3, 2)
        ref = logits["bf16 torch"]
        for side in [s for s in sides if s.startswith("bf16 fused")]:
            row[f"{side} vs torch"] = float(f"{((logits[side] - ref).abs().max() / ref.abs().max()).item():.1e}")
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
