"""Fused decode step: fp32 vs int8 vs int4 (fused and torch path) side by side in one process.

    python -m bench.ab_fused_quant MODEL_DIR [--batch 1 16] [--context 128] [--rounds 12] [--threads 1]
        [--methods int8 int4] [--head]

One runner per weight format on the same checkpoint (prefilled with the same prompts), then decode
steps round-robin over the variants (fp32 fused, then per method: fused, torch path), so load on a
shared host hits every variant alike. Reports best-step process CPU time per variant and ratios vs
fp32 fused. ``--head``: quant_lm_head for the quantized runners.
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from backend.config import EngineConfig
from backend.model.runner import SeqChunk, build_batch
from backend.model.runner import ModelRunner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--methods", nargs="+", default=["int8"])
    ap.add_argument("--head", action="store_true")
    a = ap.parse_args()
    bs = 16
    for batch in a.batch:
        per_seq = -(-(a.context + a.rounds + 2) // bs)
        args = dict(block_size=bs, num_kv_blocks=batch * per_seq, num_threads=a.threads)
        runners = {"float32": ModelRunner(a.model_dir, EngineConfig(**args))}
        for m in a.methods:
            runners[m] = ModelRunner(a.model_dir, EngineConfig(quantization=m, quant_lm_head=a.head, **args))
        rng = random.Random(0)
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
        prompts = [[rng.randrange(runners["float32"].info.vocab_size) for _ in range(a.context)]
                   for _ in range(batch)]
        for r in runners.values():
            assert r.fused is not None, "fused step not available"
            for i in range(0, batch, 8):
                r.execute(build_batch([SeqChunk(p, 0, t) for p, t in zip(prompts[i:i + 8], tables[i:i + 8])], bs))
        variants = [("float32", "fused")] + [(m, s) for m in a.methods for s in ("fused", "torch")]
        cpu = {v: [] for v in variants}
        last = {v: [p[-1] for p in prompts] for v in variants}
        for step in range(a.rounds + 1):                  # round 0: warm-up
            for v in variants:
                r = runners[v[0]]
                fused, r.fused = r.fused, (r.fused if v[1] == "fused" else None)
                b = build_batch([SeqChunk([tok], a.context + step, t) for tok, t in zip(last[v], tables)], bs)
                c0 = time.process_time()
                logits = r.execute(b)
                c = time.process_time() - c0
                r.fused = fused
                if step:
                    cpu[v].append(c)
                # every variant decodes the fp32 model's greedy tokens (same positions, same work)
                if v == ("float32", "fused"):
                    nxt = logits.argmax(-1).tolist()
            for v in variants:
                last[v] = nxt
        base = min(cpu[("float32", "fused")])
        out = {"model": a.model_dir, "batch": batch, "context": a.context, "threads": torch.get_num_threads(),
               "head": a.head}
        for v in variants:
            best = min(cpu[v])
            out[f"{v[0]}_{v[1]}_best_cpu_ms"] = round(1e3 * best, 2)
            out[f"{v[0]}_{v[1]}_speedup_vs_fp32_fused"] = round(base / best, 2)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
