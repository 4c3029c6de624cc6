"""Per-step cost of grammar masking, in process: the same decode workload with and without a JSON
schema, at 1 and 16 streams, side by side.

    python -m bench.structured --model models/default --steps 48

Every request runs exactly ``--steps`` decode steps (``ignore_eos``; the schema asks for at
least 200 objects, so the grammar never ends first). Reported per configuration: decode
tok/s, mean step time, and the time the step spent in the grammar layer (bitmask fill + apply in
``apply_constraints``, matcher advance in ``GrammarState.advance``). Runs alternate (without,
with, ``--repeats`` times) and the fastest of each is kept: on a shared machine the wall-clock
columns are noisy, the grammar column (timed inside the step) much less so.
"""
from __future__ import annotations

import argparse
import time

import backend.structured.logits as logits_mod
import backend.structured.matcher as matcher_mod
from backend import LLM, SamplingParams
from backend.structured import StructuredSpec

# At least 200 people: the grammar cannot end inside the measured steps, so both runs decode
# exactly batch x steps tokens.
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "items": PERSON, "minItems": 200}},
          "required": ["people"]}


class _Clock:
    def __init__(self):
        self.total = 0.0

    def wrap(self, fn):
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.total += time.perf_counter() - t
        return timed


def run(llm: LLM, batch: int, steps: int, constrained: bool) -> dict:
    spec = StructuredSpec.json(SCHEMA) if constrained else None
    tok = llm.tokenizer
    prompt = list(tok.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}],
                                          add_generation_prompt=True, return_dict=False))
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=steps, ignore_eos=True, structured=spec)
              for i in range(batch)]
    llm.generate([prompt] * batch, [SamplingParams(max_tokens=2, structured=spec)] * batch)   # warm + compile
    clock = _Clock()
    apply, advance = logits_mod.apply_constraints, matcher_mod.GrammarState.advance
    logits_mod.apply_constraints = clock.wrap(apply)
    matcher_mod.GrammarState.advance = clock.wrap(advance)
    import backend.engine.sampler as sampler_mod
    sampler_mod.apply_constraints = logits_mod.apply_constraints
    try:
        t = time.perf_counter()
        outs = llm.generate([prompt] * batch, params)
        wall = time.perf_counter() - t
    finally:
        logits_mod.apply_constraints = sampler_mod.apply_constraints = apply
        matcher_mod.GrammarState.advance = advance
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    n_steps = max(len(o.outputs[0].token_ids) for o in outs)
    return {"batch": batch, "schema": constrained, "tok_s": tokens / wall, "step_ms": 1000 * wall / n_steps,
            "grammar_ms": 1000 * clock.total / n_steps, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/default")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs per row; the fastest is kept")
    args = ap.parse_args()
    llm = LLM(args.model, num_kv_blocks=256, num_threads=args.threads)
    print(f"model {args.model}  vocab {llm.engine.vocab_size}  steps {args.steps}")
    print(f"{'streams':>7} {'schema':>6} {'tok/s':>8} {'step ms':>8} {'grammar ms/step':>16} {'overhead':>8}")
    for b in (int(x) for x in args.batches.split(",")):
        runs = [(run(llm, b, args.steps, False), run(llm, b, args.steps, True)) for _ in range(args.repeats)]
        base = min((r[0] for r in runs), key=lambda r: r["step_ms"])
        cons = min((r[1] for r in runs), key=lambda r: r["step_ms"])
        for r in (base, cons):
            over = f"{100 * (r['step_ms'] / base['step_ms'] - 1):+.1f}%" if r is cons else ""
            print(f"{r['batch']:>7} {('yes' if r['schema'] else 'no'):>6} {r['tok_s']:>8.1f} {r['step_ms']:>8.2f} "
                  f"{r['grammar_ms']:>16.3f} {over:>8}")


if __name__ == "__main__":
    main()
