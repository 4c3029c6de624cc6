"""Forward-speed check of the model runner: prefill, then timed decode steps of a full batch.

    python -m bench.model_step MODEL_DIR [--batch 64] [--context 128] [--steps 10] [--dtype bfloat16]
    python -m bench.model_step MODEL_DIR --batch 1 --threads 1 --ab-fused
    python -m bench.model_step MODEL_DIR --batch 8 --context 288 --threads 1 --kv-cache-dtype fp16

Prints one JSON line: prefill and decode tokens/s and ms per decode step (wall clock, best step
and mean), and the process CPU time of the best step (robust when other work shares the cores).
``--ab-fused``: decode steps alternate between the fused C step (backend/model/fused_decode.py)
and the torch path in the same process, and both are reported (``torch_*`` / ``fused_*``).
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


def run(model_dir: str, *, batch: int, context: int, steps: int, dtype: str, block_size: int = 16,
        backend: str = "auto", num_threads: int | None = None, ab_fused: bool = False,
        kv_cache_dtype: str = "auto") -> dict:
    blocks_per_seq = -(-(context + steps + 1) // block_size)    # steps + 1: step 0 is a warm-up
    runner = ModelRunner(model_dir, EngineConfig(dtype=dtype, block_size=block_size, attention_backend=backend,
                                                 kv_cache_dtype=kv_cache_dtype, num_kv_blocks=batch * blocks_per_seq,
                                                 num_threads=num_threads))
    rng = random.Random(0)
    free = rng.sample(range(runner.num_blocks), runner.num_blocks)
    tables = [free[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(batch)]
    prompts = [[rng.randrange(runner.info.vocab_size) for _ in range(context)] for _ in range(batch)]

    t0 = time.perf_counter()
    for i in range(0, batch, 8):                 # prefill in batches of 8 prompts
        runner.execute(build_batch([SeqChunk(p, 0, t) for p, t in zip(prompts[i:i + 8], tables[i:i + 8])],
                                   block_size))
    prefill_s = time.perf_counter() - t0

    last = [p[-1] for p in prompts]
    times, cpu = [], []
    fused, ab = runner.fused, {"torch": ([], []), "fused": ([], [])}
    for step in range(steps + 1):               # step 0 is a warm-up
        b = build_batch([SeqChunk([tok], context + step, t) for tok, t in zip(last, tables)], block_size)
        if ab_fused:                            # odd steps fused, even steps torch (step 0: warm-up)
            runner.fused = fused if step % 2 else None
        t0, c0 = time.perf_counter(), time.process_time()
        logits = runner.execute(b)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        last = logits.argmax(-1).tolist()
        if ab_fused and step > 1:
            side = ab["fused" if step % 2 else "torch"]
            side[0].append(times[-1])
            side[1].append(cpu[-1])
    runner.fused = fused
    decode_s = sum(times[1:])
    extra = {}
    if ab_fused:
        if fused is None:
            raise SystemExit("--ab-fused: the fused decode step is not available for this model/setup")
        for name, (t, c) in ab.items():
            extra.update({f"{name}_best_ms": round(1e3 * min(t), 2),
                          f"{name}_mean_ms": round(1e3 * sum(t) / len(t), 2),
                          f"{name}_best_cpu_ms": round(1e3 * min(c), 2)})
        extra["speedup_best_cpu"] = round(min(ab["torch"][1]) / min(ab["fused"][1]), 2)
    return {"model": model_dir, "dtype": dtype, "kv_cache_dtype": kv_cache_dtype, "backend": runner.attention.name,
            "threads": torch.get_num_threads(),
            "batch": batch, "context": context, "prefill_tok_s": round(batch * context / prefill_s, 1),
            "decode_tok_s": round(batch * steps / decode_s, 1), "decode_ms_per_step": round(1e3 * decode_s / steps, 2),
            "decode_best_tok_s": round(batch / min(times[1:]), 1), "decode_best_cpu_ms": round(1e3 * min(cpu[1:]), 2), **extra}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto | fp16 | bf16 (EngineConfig.kv_cache_dtype)")
    ap.add_argument("--ab-fused", action="store_true", help="alternate fused C step and torch path")
    a = ap.parse_args()
    print(json.dumps(run(a.model_dir, batch=a.batch, context=a.context, steps=a.steps, dtype=a.dtype,
                         backend=a.backend, num_threads=a.threads, ab_fused=a.ab_fused,
                         kv_cache_dtype=a.kv_cache_dtype)))


if __name__ == "__main__":
    main()
