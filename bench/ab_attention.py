"""A/B of the CPU decode attention's row kernels (kernels/csrc/paged_cpu.c: the 8-lane rows vs the
16-lane GQA-group rows of paged_avx512.h) on the peers workload, in process, alternating in one run.

    .venv/bin/python -m bench.ab_attention MODEL_DIR [--dtype bfloat16] [--streams 16 1]
        [--requests 64] [--requests-1 8] [--rounds 3]
    .venv/bin/python -m bench.ab_attention MODEL_DIR --step [--batch 16] [--context 170] [--steps 20]

Per stream count, ``--rounds`` rounds of old and new alternating (the order flips each round), the
workload of bench/profile_steps.py (prompts 16-256 tokens, outputs mean 64, greedy, ignore_eos, a
closed loop of the given streams; 1 stream runs ``--requests-1`` requests). Prints each run's output
tok/s (wall) and tokens per CPU second, the best of each side, and whether both sides gave the same
tokens (summation order differs: a near-tie may flip, so this is reported, not asserted).
"""
from __future__ import annotations

import argparse

from backend import LLM, SamplingParams
from bench.profile_steps import make_requests, run
from kernels import cpu


def set_wide(on: int) -> None:
    for lib in (cpu.library(), cpu.decode_library()):
        if lib is not None:
            lib.paged_set_wide(on)


def step_ab(model_dir: str, dtype: str, batch: int, context: int, steps: int, threads: int | None) -> None:
    """Fused decode steps of ``batch`` sequences at ``context`` tokens and prefill chunks of one
    ``context``-token prompt, the two row kernels alternating step by step; best wall / CPU ms."""
    import random
    import time

    from backend.config import EngineConfig
    from backend.model.runner import SeqChunk, build_batch
    from backend.model.runner import ModelRunner

    bs, per_seq = 16, -(-(context + 2 * steps + 3) // 16)
    runner = ModelRunner(model_dir, EngineConfig(dtype=dtype, block_size=bs, num_kv_blocks=(batch + 1) * per_seq,
                                                 num_threads=threads))
    rng = random.Random(0)
    free = rng.sample(range(runner.num_blocks), runner.num_blocks)
    tables = [free[i * per_seq:(i + 1) * per_seq] for i in range(batch + 1)]
    prompts = [[rng.randrange(runner.info.vocab_size) for _ in range(context)] for _ in range(batch + 1)]
    for i in range(0, batch, 8):
        runner.execute(build_batch([SeqChunk(p, 0, t) for p, t in zip(prompts[i:i + 8], tables[i:i + 8])], bs))
    last = [p[-1] for p in prompts[:batch]]
    res: dict[str, list[tuple[float, float]]] = {f"{k} {s}": [] for k in ("decode", "prefill") for s in ("old", "new")}
    for step in range(2 * steps + 2):
        side = ("old", "new")[step % 2]
        set_wide(side == "new")
        b = build_batch([SeqChunk([tok], context + step, t) for tok, t in zip(last, tables)], bs)
        t0, c0 = time.perf_counter(), time.process_time()
        last = runner.execute(b).argmax(-1).tolist()
        res[f"decode {side}"].append((time.perf_counter() - t0, time.process_time() - c0))
        b = build_batch([SeqChunk(prompts[batch], 0, tables[batch])], bs)    # the same prompt again
        t0, c0 = time.perf_counter(), time.process_time()
        runner.execute(b)
        res[f"prefill {side}"].append((time.perf_counter() - t0, time.process_time() - c0))
    set_wide(True)
    for k, v in res.items():
        v = v[1:]                                                               # the first is a warm-up
        print(f"{dtype} {k}: best {1e3 * min(w for w, _ in v):.2f} ms wall, {1e3 * min(c for _, c in v):.2f} ms CPU "
              f"({'%d decodes at %d' % (batch, context) if k.startswith('decode') else '%d-token prompt' % context})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--streams", type=int, nargs="+", default=[16, 1])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--requests-1", type=int, default=8, help="requests of the 1-stream runs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--step", action="store_true",
                    help="instead: decode steps of --batch sequences at --context tokens and a prefill of one "
                         "--context-token prompt, alternating step by step (--steps each)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=170)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    if a.step:
        step_ab(a.model_dir, a.dtype, a.batch, a.context, a.steps, a.threads)
        return
    opts = {"kv_cache_memory": 1 << 30, "max_num_seqs": 64, "dtype": a.dtype}
    if a.threads:
        opts["num_threads"] = a.threads
    llm = LLM(a.model_dir, **opts)
    vocab = llm.engine.runner.info.vocab_size
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    for streams in a.streams:
        reqs = make_requests(a.requests if streams > 1 else a.requests_1, 0, vocab)
        best: dict[str, dict] = {}
        outs: dict[str, dict] = {}
        for r in range(a.rounds):
            for side in ("old", "new") if r % 2 == 0 else ("new", "old"):
                set_wide(side == "new")
                res = run(llm, reqs, streams, f"{side}{streams}-{r}")
                outs[side] = res.pop("outputs")
                tokens = sum(len(v) for v in outs[side].values())
                print(f"{a.dtype} {streams} streams round {r} {side}: {res['tok_s']:.1f} tok/s, "
                      f"{tokens / res['cpu_s']:.1f} tok per CPU s", flush=True)
                if side not in best or res["tok_s"] > best[side]["tok_s"]:
                    best[side] = {**res, "tok_cpu": tokens / res["cpu_s"]}
        o, n = best["old"], best["new"]
        print(f"== {a.dtype} {streams} streams best: old {o['tok_s']:.1f} tok/s ({o['tok_cpu']:.1f}/CPU s), "
              f"new {n['tok_s']:.1f} tok/s ({n['tok_cpu']:.1f}/CPU s): x{n['tok_s'] / o['tok_s']:.3f} wall, "
              f"x{n['tok_cpu'] / o['tok_cpu']:.3f} CPU; same tokens: {outs['old'] == outs['new']}", flush=True)
    set_wide(1)


if __name__ == "__main__":
    main()
