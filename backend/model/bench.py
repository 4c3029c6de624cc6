"""Forward-speed check of the model runner: prefill, then timed decode steps of a full batch.

    python -m backend.model.bench MODEL_DIR [--batch 64] [--context 128] [--steps 10] [--dtype bfloat16]

Prints one JSON line: prefill and decode tokens/s and ms per decode step (wall clock, best step
and mean), and the process CPU time of the best step (robust when other work shares the cores).
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from backend.config import EngineArgs
from backend.model.batch_builder import SeqChunk, build_batch
from backend.model.runner import ModelRunner


def run(model_dir: str, *, batch: int, context: int, steps: int, dtype: str, block_size: int = 16,
        backend: str = "auto", num_threads: int | None = None) -> dict:
    blocks_per_seq = -(-(context + steps) // block_size)
    runner = ModelRunner(model_dir, EngineArgs(dtype=dtype, block_size=block_size, attention_backend=backend,
                                               num_kv_blocks=batch * blocks_per_seq, num_threads=num_threads))
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
    for step in range(steps + 1):               # step 0 is a warm-up
        b = build_batch([SeqChunk([tok], context + step, t) for tok, t in zip(last, tables)], block_size)
        t0, c0 = time.perf_counter(), time.process_time()
        logits = runner.execute(b)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        last = logits.argmax(-1).tolist()
    decode_s = sum(times[1:])
    return {"model": model_dir, "dtype": dtype, "backend": runner.attention.name, "threads": torch.get_num_threads(),
            "batch": batch, "context": context, "prefill_tok_s": round(batch * context / prefill_s, 1),
            "decode_tok_s": round(batch * steps / decode_s, 1), "decode_ms_per_step": round(1e3 * decode_s / steps, 2),
            "decode_best_tok_s": round(batch / min(times[1:]), 1), "decode_best_cpu_ms": round(1e3 * min(cpu[1:]), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    print(json.dumps(run(a.model_dir, batch=a.batch, context=a.context, steps=a.steps, dtype=a.dtype,
                         backend=a.backend, num_threads=a.threads)))


if __name__ == "__main__":
    main()
