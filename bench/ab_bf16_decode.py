"""bf16 1-stream decode step of the fused C step, A/B in one process (issue 28: where a SmolLM2 bf16
decode's time goes and what makes it faster):

    .venv/bin/python -m bench.ab_bf16_decode [MODEL] [--threads 2] [--reps 200] [--ctx 128] [--decodes 1]

Sides, interleaved step by step (a burst of load on a shared host hits both alike): ``huge`` the
decoder as built (packed bf16 copies in a huge-page arena, backend/model/fused_decode.py) and
``4k`` the same with the packed copies in torch's allocations (4 KiB pages). Prints best, 10th
percentile and median wall ms per ``runner.execute`` of ``--decodes`` decodes at ``--ctx`` tokens
of context, the weight bytes read per step (the packed copies) and the GB/s that best reaches,
and the largest logit difference between the sides (0 expected: same kernels, same weights).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from backend.config import EngineConfig
from backend.model import loader
from backend.model.fused_decode import FusedDecoder
from backend.model.runner import ModelRunner
from bench.ab_dtype_step import BLOCKS, BS, make_batch
from load.stack import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="models/default")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--decodes", type=int, default=1)
    a = ap.parse_args()
    r = ModelRunner(str(resolve_model(a.model)),
                    EngineConfig(block_size=BS, num_kv_blocks=BLOCKS, num_threads=a.threads, dtype="bfloat16"))
    if r.fused is None or not r.fused.bf16:
        raise SystemExit("no bf16 fused step here")
    sides = {"huge": r.fused}
    on = loader.huge_pages_enabled
    loader.huge_pages_enabled = lambda: False
    try:
        sides["4k"] = FusedDecoder(r.model, r.kv_caches, BS, r.fused._lib, bgemm_min_m=r.fused.bgemm_min_m)
    finally:
        loader.huge_pages_enabled = on
    nbytes = sum(p.numel() * p.element_size() for p in r.fused._packed)
    batch = make_batch([(a.ctx, 1)] * a.decodes, r.info.vocab_size, random.Random(0))
    times: dict[str, list[float]] = {s: [] for s in sides}
    logits: dict[str, torch.Tensor] = {}
    for rep in range(a.reps + 1):
        for side in (list(sides) if rep % 2 else list(sides)[::-1]):
            r.fused = sides[side]
            t0 = time.perf_counter()
            logits[side] = r.execute(batch)
            if rep:
                times[side].append(time.perf_counter() - t0)
    ref = logits["huge"]
    for side, ts in times.items():
        ts.sort()
        print(json.dumps({"side": side, "decodes": a.decodes, "ctx": a.ctx, "threads": a.threads,
                          "best ms": round(ts[0] * 1e3, 3), "p10 ms": round(ts[len(ts) // 10] * 1e3, 3),
                          "median ms": round(statistics.median(ts) * 1e3, 3), "weight MB": round(nbytes / 1e6, 1),
                          "GB/s at best": round(nbytes / ts[0] / 1e9, 1),
                          "max |logit diff|": float((logits[side] - ref).abs().max())}), flush=True)


if __name__ == "__main__":
    main()
