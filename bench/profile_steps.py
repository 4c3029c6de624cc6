"""Where an in-process engine's time goes on the peers workload, per kind of step, and the same
workload with the fused C step in its modes, alternating in one process.

    .venv/bin/python -m bench.profile_steps MODEL_DIR [--streams 16] [--requests 64] [--rounds 2]
        [--modes torch,decode,varlen] [--threads N] [--dtype D] [--engine-option K=V]

Workload: load/peers.py's shape in token ids -- prompts uniform in 16..256 tokens (corpus windows),
outputs exponential with mean 64 capped at 256, greedy, ignore_eos; a closed loop of ``--streams``
clients (a request is added as soon as one finishes, as a benchmark client would send its next).
Each run uses its own prefix-cache salt, so no run reuses another's KV (with ``--prime``: all share one warm cache).

Modes: ``torch`` (no fused step), ``decode`` (fused all-decode steps only, the budget 0),
``varlen`` (fused steps with prefill chunks up to TRITON_LLM_FUSED_MAX_TOKENS / the default budget).
Per mode: wall and process CPU seconds, output tok/s, and the time inside ``runner.execute`` split
into all-decode steps, mixed steps (prefill chunk + decodes) and prefill-only steps (count, ms per
step, new tokens per step); the rest is the engine around the model (scheduler, sampler, batch
building). The summary compares the best run of each mode by CPU seconds (with one torch thread,
robust to other work on a shared host).
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import time

import torch

from backend import LLM, SamplingParams
from backend.config import EngineArgs
from load.stack import parse_options


_RUNS = iter(range(1 << 30))


def make_requests(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    from load.workloads import _corpus_ids

    ids = [t for t in _corpus_ids() if t < vocab]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        plen = rng.randint(16, 256)
        olen = min(256, max(1, round(rng.expovariate(1 / 64))))
        start = rng.randrange(len(ids))
        out.append(((ids[start:] + ids)[:plen], olen))
    return out


def run(llm: LLM, reqs, streams: int, salt: str) -> dict:
    """One closed-loop pass; request ids are unique per call, the prefix-cache salt is ``salt``."""
    tag = f"{salt}-{next(_RUNS)}"
    engine, runner = llm.engine, llm.engine.runner
    kinds = collections.defaultdict(lambda: [0, 0.0, 0, 0.0])  # kind -> [steps, seconds, tokens, CPU seconds]
    execute = runner.execute

    def timed(batch):
        n, s = batch.input_ids.shape[0], batch.seq_lens.shape[0]
        q = (batch.cu_seqlens_q[1:] - batch.cu_seqlens_q[:-1]).tolist()
        kind = "decode" if n == s else ("mixed" if 1 in q else "prefill")
        t0, c0 = time.perf_counter(), time.process_time()
        out = execute(batch)
        k = kinds[kind]
        k[0] += 1
        k[1] += time.perf_counter() - t0
        k[2] += n
        k[3] += time.process_time() - c0
        return out

    runner.execute = timed
    todo = list(enumerate(reqs))[::-1]
    outputs: dict[int, list[int]] = collections.defaultdict(list)
    open_ = 0
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        while todo or engine.has_unfinished():
            while todo and open_ < streams:
                i, (p, o) = todo.pop()
                engine.add_request(f"{tag}-{i}", p, SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True),
                                   stream=True, salt=salt)
                open_ += 1
            for d in engine.step():
                outputs[int(d.request_id.rsplit("-", 1)[1])] += d.new_token_ids
                if d.finished:
                    open_ -= 1
    finally:
        runner.execute = execute
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(v) for v in outputs.values())
    assert tokens == sum(o for _, o in reqs)
    return {"wall_s": wall, "cpu_s": cpu, "tok_s": tokens / wall,
            "steps": {k: {"count": v[0], "seconds": v[1], "ms_per_step": 1e3 * v[1] / v[0],
                          "tokens_per_step": v[2] / v[0], "cpu_seconds": v[3], "cpu_ms_per_step": 1e3 * v[3] / v[0]}
                      for k, v in sorted(kinds.items())},
            "outputs": dict(outputs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", default="torch,decode,varlen")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default=None, help="the engine's dtype (float32, bfloat16, ...; default: its own)")
    ap.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                    help="another engine option (e.g. quantization=int8), repeatable")
    ap.add_argument("--json", default=None, help="write every run here")
    ap.add_argument("--prime", action="store_true",
                    help="run the requests once untimed first and let every run share that prefix cache "
                         "(the peers 1-stream phase: prompts already seen, only the last partial block prefills)")
    a = ap.parse_args()
    opts = {"kv_cache_memory": str(1 << 30), "max_num_seqs": "64", "num_threads": str(a.threads or ""),
            "dtype": a.dtype or "", **parse_options(a.engine_option)}
    args = EngineArgs.from_dict(opts)         # typed and checked as the server reads them ("" = default)
    llm = LLM(a.model_dir, engine=args.engine, lora=args.lora)
    runner = llm.engine.runner
    fused = runner.fused
    budget = fused.max_tokens if fused is not None else 0
    reqs = make_requests(a.requests, a.seed, runner.info.vocab_size)
    llm.generate([reqs[0][0][:8]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))   # warm-up
    modes = a.modes.split(",")
    if fused is None and modes != ["torch"]:
        raise SystemExit("the fused step is not available for this model/setup")
    if a.prime:
        run(llm, reqs, a.streams, "prime")
    runs = collections.defaultdict(list)
    outs = {}
    for r in range(a.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            runner.fused = None if mode == "torch" else fused
            if fused is not None:
                fused.max_tokens = 0 if mode == "decode" else budget
            res = run(llm, reqs, a.streams, "prime" if a.prime else f"{mode}{r}")
            outs[mode] = res.pop("outputs")
            runs[mode].append(res)
            steps = " ".join(f"{k} {v['count']}x{v['ms_per_step']:.1f}ms ({v['tokens_per_step']:.0f} tok, "
                             f"CPU {v['cpu_ms_per_step']:.1f}ms) = {v['seconds']:.2f}s (CPU {v['cpu_seconds']:.2f}s)"
                             for k, v in res["steps"].items())
            print(f"round {r} {mode}: wall {res['wall_s']:.2f}s cpu {res['cpu_s']:.2f}s {res['tok_s']:.1f} tok/s | {steps}",
                  flush=True)
    runner.fused = fused
    if fused is not None:
        fused.max_tokens = budget
    print(f"{a.model_dir}: {a.streams} streams, {a.requests} requests, threads {torch.get_num_threads()}, "
          f"fused budget {budget} tokens")
    # CPU seconds: robust to other work on a shared host (with one torch thread); wall for reference.
    best = {m: min(v, key=lambda x: x["cpu_s"]) for m, v in runs.items()}
    for m, b in best.items():
        in_model = sum(v["cpu_seconds"] for v in b["steps"].values())
        split = ", ".join(f"{k} {v['cpu_seconds'] / b['cpu_s']:.0%}" for k, v in b["steps"].items())
        print(f"best {m}: CPU {b['cpu_s']:.2f}s ({sum(len(o) for o in outs[m].values()) / b['cpu_s']:.1f} tok per CPU s), "
              f"wall {b['wall_s']:.2f}s; CPU in the model {in_model / b['cpu_s']:.0%} ({split}); "
              f"same tokens as {modes[0]}: {outs[m] == outs[modes[0]]}")
    if "torch" in best:
        for m in best:
            print(f"{m} vs torch: CPU {best['torch']['cpu_s'] / best[m]['cpu_s']:.2f}x, "
                  f"wall {best['torch']['wall_s'] / best[m]['wall_s']:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
