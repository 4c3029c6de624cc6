"""Offline engine (LLM.generate, greedy, ignore_eos) with the fused C decode step on and off,
alternating in one process; prints best wall and CPU ms per output token-step for each side.

    .venv/bin/python -m bench.ab_fused_engine MODEL_DIR STREAMS MAX_TOKENS [ROUNDS]

Prompts are 64 tokens, so the numbers include prefill amortized over MAX_TOKENS steps.
"""
import argparse
import time

from backend.llm import LLM
from backend.engine.admission import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("streams", type=int)
    ap.add_argument("max_tokens", type=int)
    ap.add_argument("rounds", type=int, nargs="?", default=3)
    a = ap.parse_args()
    model, n, toks, rounds = a.model_dir, a.streams, a.max_tokens, a.rounds
    llm = LLM(model, num_threads=1, kv_cache_memory=1 << 28)
    sp = SamplingParams(max_tokens=toks, temperature=0.0, ignore_eos=True)
    prompts = [[5 + i, 17, 99, 230, 41, 7, 8, 9] * 8 for i in range(n)]
    fused = llm.engine.runner.fused
    if fused is None:
        raise SystemExit("the fused decode step is not available for this model/setup")
    res = {"fused": [], "torch": []}
    outs = {}
    for _ in range(rounds):
        for name in ("fused", "torch"):
            llm.engine.runner.fused = fused if name == "fused" else None
            t0, c0 = time.perf_counter(), time.process_time()
            outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
            res[name].append((time.perf_counter() - t0, time.process_time() - c0))
    for name, v in res.items():
        print(f"{model} streams {n} {name}: best wall ms/step {1e3 * min(w for w, _ in v) / toks:.2f}, "
              f"best CPU ms/step {1e3 * min(c for _, c in v) / toks:.2f}")
    print("same tokens:", outs["fused"] == outs["torch"])


if __name__ == "__main__":
    main()
