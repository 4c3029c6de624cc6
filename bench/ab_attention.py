"""A/B of the CPU decode attention's row kernels (kernels/csrc/paged_cpu.c: the 8-lane rows vs the
16-lane GQA-group rows of paged_avx512.h) on the peers workload, in process, alternating in one run.

    .venv/bin/python -m bench.ab_attention MODEL_DIR [--dtype bfloat16] [--streams 16 1]
        [--requests 64] [--requests-1 8] [--rounds 3]

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--streams", type=int, nargs="+", default=[16, 1])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--requests-1", type=int, default=8, help="requests of the 1-stream runs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
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
