"""Per-step cost of the fused C step (kernels/csrc/decode_cpu.c) against the torch path, side by side:
each repetition runs the same batch through both, alternating; prints best-of-N wall and CPU ms.

    .venv/bin/python -m bench.ab_fused_step MODEL_DIR [--reps 7] [--threads N] [--cases tail,prefill,mixed,decode]

Cases (block size 16, random token ids, a fresh block table per sequence):
    tail N+q    one sequence, N tokens already cached (a prefix-cache hit), q new tokens (q = 1..16:
                the partial block a 1-stream request still prefills)
    prefill L   one sequence, an L-token prompt from scratch (L from --prefill-lens)
    mixed L+15  one L-token prompt plus 15 decodes at ~128 tokens of context (a 16-stream step in
                which a new request arrives)
    decode 16   16 decodes at ~128 tokens of context

The fused side is ``runner.fused`` with its token budget lifted (``max_tokens``), the torch side
``runner.fused = None``. Both write the same K/V slots, so the alternation needs no reset.
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

BS = 16


def cases(which: list[str], rng: random.Random, lens: list[int]) -> list[tuple[str, list[tuple[int, int]]]]:
    """(name, [(cached tokens, new tokens) per sequence])."""
    out = []
    if "tail" in which:
        out += [(f"tail 128+{q}", [(128, q)]) for q in (1, 2, 4, 8, 16)]
    if "prefill" in which:
        out += [(f"prefill {n}", [(0, n)]) for n in lens]
    if "mixed" in which:
        out += [(f"mixed {n}+15", [(0, n)] + [(rng.randrange(64, 192), 1) for _ in range(15)]) for n in (16, 136, 256)]
    if "decode" in which:
        out += [("decode 16", [(rng.randrange(64, 192), 1) for _ in range(16)])]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cases", default="tail,prefill,mixed,decode")
    ap.add_argument("--quantization", default="none", help="none | int8 | int4 (weight-only, both sides)")
    ap.add_argument("--prefill-lens", default="16,64,136,256,512", help="prompt lengths of the prefill case")
    a = ap.parse_args()
    rng = random.Random(0)
    runner = ModelRunner(a.model_dir, EngineConfig(block_size=BS, num_kv_blocks=2048, num_threads=a.threads,
                                                   quantization=a.quantization))
    fused = runner.fused
    if fused is None:
        raise SystemExit("the fused step is not available for this model/setup")
    fused.max_tokens = 1 << 30
    vocab, free = runner.info.vocab_size, list(range(runner.num_blocks))
    rows = []
    for name, shape in cases(a.cases.split(","), rng, [int(x) for x in a.prefill_lens.split(",")]):
        chunks = []
        for cached, new in shape:
            nb = -(-(cached + new) // BS)
            table, free = free[:nb], free[nb:] + free[:nb]        # reuse blocks round-robin
            toks = [rng.randrange(vocab) for _ in range(cached + new)]
            if cached:                                              # the cached prefix, torch path
                runner.fused = None
                runner.execute(build_batch([SeqChunk(toks[:cached], 0, table)], BS))
            chunks.append(SeqChunk(toks[cached:], cached, table))
        batch = build_batch(chunks, BS)
        res = {"fused": [], "torch": []}
        for rep in range(a.reps + 1):                               # rep 0: warm-up
            for side in ("fused", "torch") if rep % 2 else ("torch", "fused"):
                runner.fused = fused if side == "fused" else None
                t0, c0 = time.perf_counter(), time.process_time()
                logits = runner.execute(batch)
                t, c = time.perf_counter() - t0, time.process_time() - c0
                if rep:
                    res[side].append((t, c))
                if side == "fused":
                    lf = logits
                else:
                    lt = logits
        err = ((lf - lt).abs().max() / lt.abs().max()).item()
        bw = {k: min(t for t, _ in v) * 1e3 for k, v in res.items()}
        bc = {k: min(c for _, c in v) * 1e3 for k, v in res.items()}
        row = {"case": name, "tokens": batch.input_ids.shape[0], "torch_wall_ms": round(bw["torch"], 2),
               "fused_wall_ms": round(bw["fused"], 2), "wall_speedup": round(bw["torch"] / bw["fused"], 2),
               "torch_cpu_ms": round(bc["torch"], 2), "fused_cpu_ms": round(bc["fused"], 2),
               "cpu_speedup": round(bc["torch"] / bc["fused"], 2), "max_rel_diff": float(f"{err:.1e}")}
        rows.append(row)
        print(json.dumps(row), flush=True)
    runner.fused = fused
    print(f"{a.model_dir}: threads {torch.get_num_threads()}, reps {a.reps}")
    print("| case | tokens | torch ms | fused ms | speed-up (wall) | torch CPU ms | fused CPU ms | speed-up (CPU) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['tokens']} | {r['torch_wall_ms']} | {r['fused_wall_ms']} | {r['wall_speedup']}x "
              f"| {r['torch_cpu_ms']} | {r['fused_cpu_ms']} | {r['cpu_speedup']}x |")


if __name__ == "__main__":
    main()
