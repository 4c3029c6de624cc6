"""Speculative decoding, side by side in one run: tokens/s with it off and on, same prompts.

    python -m bench.spec --model models/default [--draft DIR] [--k 4] [--max-tokens 128]

Workloads (chat template applied when the tokenizer has one):
  grounded  "repeat / edit / summarize this passage" prompts, 1 stream (prompt lookup's case)
  chat      free-form questions, 1 stream (little to copy: must not slow down)
  batch16   16 streams of grounded + chat prompts at once (the back-off's case)
Each configuration runs every workload with the same greedy settings, alternating runs so a
noisy neighbour hits all configurations alike; outputs are checked equal to the baseline.
"""
from __future__ import annotations

import argparse
import json
import time

from backend import LLM, SamplingParams

PASSAGE = (
    "The engine runs one step at a time. Each step, the scheduler picks the running sequences "
    "first and then admits waiting prompts while the token budget lasts. The model runner executes "
    "the flattened batch, writing keys and values into the paged cache, and the sampler picks one "
    "token for every sequence that reached its last known token. Finished sequences free their "
    "blocks at once, so a new request can start in the very next step.")
PASSAGE2 = (
    "Prefix caching keeps full blocks of computed tokens in a hash map keyed by the hash of the "
    "previous block and the block's own tokens. A new prompt that shares a prefix with an earlier "
    "one reuses those blocks instead of computing them again, which shortens the time to the first "
    "token for chat turns that resend the whole conversation.")
GROUNDED = [
    f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}",
    f"Fix any typos in this text and return the full corrected text:\n\n{PASSAGE2.replace('the', 'teh', 2)}",
    f"Rewrite this passage, keeping every sentence but replacing the word 'sequence' with 'request':\n\n{PASSAGE}",
    f"Copy this paragraph, then add one sentence at the end:\n\n{PASSAGE2}",
]
CHAT = [
    "Write a short poem about the sea.",
    "What are three good habits for staying healthy?",
    "Explain in a few sentences why the sky is blue.",
    "Give me an idea for a birthday party for a ten-year-old.",
]


def _prompts(llm: LLM, texts: list[str]) -> list[list[int]]:
    tok = llm.tokenizer
    if getattr(tok, "chat_template", None):
        return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False) for t in texts]
    return [tok.encode(t) for t in texts]


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams, streams: int) -> tuple[float, int, list]:
    """Generate ``prompts`` with at most ``streams`` at once; (seconds, tokens, outputs)."""
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), streams):
        outs += [tuple(o.outputs[0].token_ids) for o in llm.generate(prompts[i:i + streams], params)]
    return time.perf_counter() - t0, sum(len(o) for o in outs), outs


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/default")
    ap.add_argument("--draft", default=None, help="draft checkpoint (same tokenizer) for method draft_model")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workloads", default="grounded,chat,batch16")
    a = ap.parse_args(argv)

    common = dict(num_threads=a.threads, num_kv_blocks=512, max_num_seqs=16)
    configs = {"off": None,
               "ngram": {"method": "ngram", "num_speculative_tokens": a.k,
                         "prompt_lookup_min": a.lookup_min, "prompt_lookup_max": a.lookup_max}}
    if a.draft:
        configs["draft_model"] = {"method": "draft_model", "model": a.draft, "num_speculative_tokens": a.k}
    llms = {name: LLM(a.model, speculative_config=cfg, **common) for name, cfg in configs.items()}
    some = next(iter(llms.values()))
    work = {"grounded": (_prompts(some, GROUNDED), 1), "chat": (_prompts(some, CHAT), 1),
            "batch16": (_prompts(some, (GROUNDED + CHAT) * 2), 16)}
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    for llm in llms.values():                     # warm-up (allocations, C kernels)
        llm.generate(work["chat"][0][:1], SamplingParams(temperature=0, max_tokens=8))
    results: dict = {}
    for w in a.workloads.split(","):
        prompts, streams = work[w]
        acc = {name: [0.0, 0, 0, 0, None] for name in llms}     # secs, tokens, drafted, accepted, outputs
        for _ in range(a.repeats):
            for name, llm in llms.items():
                s0 = llm.engine.stats()
                secs, toks, outs = _run(llm, prompts, params, streams)
                s1 = llm.engine.stats()
                r = acc[name]
                r[0] += secs
                r[1] += toks
                r[2] += s1.spec_drafted_tokens - s0.spec_drafted_tokens
                r[3] += s1.spec_accepted_tokens - s0.spec_accepted_tokens
                r[4] = outs
        base = acc["off"][1] / acc["off"][0]
        results[w] = {}
        for name, (secs, toks, drafted, accepted, outs) in acc.items():
            tps = toks / secs
            results[w][name] = {"tok_s": round(tps, 2), "speedup": round(tps / base, 3),
                                "acceptance": round(accepted / drafted, 3) if drafted else None,
                                "drafted": drafted, "accepted": accepted,
                                "same_as_off": outs == acc["off"][4]}
            print(f"{w:9s} {name:12s} {tps:8.2f} tok/s  x{tps / base:5.2f}  acceptance "
                  f"{results[w][name]['acceptance']}  same_as_off={results[w][name]['same_as_off']}", flush=True)
    print(json.dumps({"args": vars(a), "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
