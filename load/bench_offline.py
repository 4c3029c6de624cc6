"""Offline throughput, side by side in one run, for each model:

    engine   our LLM(...).generate over all requests (continuous batching, paged KV; the
             preset's benchmark options from load/stack.py, e.g. a KV pool that never preempts)
    hf-seq   Hugging Face ``generate`` one request at a time (a seeded sample of 32, extrapolated)
    static   naive static batching: groups of 16 in arrival order, left-padded, every group decodes
             until its longest request is done (HF ``generate`` on the batch with
             min_new_tokens = max_new_tokens = the group's longest output); a seeded sample of 8
             of the 16 groups, extrapolated (HF on 2 CPU cores needs minutes per model otherwise)

    python -m load.bench_offline --models bench-15m bench-110m

Workload (seeded): 256 requests, prompt lengths uniform in 8..256 tokens, output lengths
exponential with mean 64, capped at 256 (at least 1), ignore_eos, greedy. Throughput counts the
requested output tokens only (a static group's padding rows are waste). The static baseline's
padding-waste ceiling is the fraction of its token slots that carry no useful token: an ideal
unpadded batcher could be at most 1 / (1 - waste) times faster on the same compute.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import sys
import time

from load.stack import ROOT, engine_options, resolve_model
from load.summary import json_safe

RESULTS = ROOT / "load" / "results"
GROUP = 16


def make_requests(n: int, seed: int, vocab_ids: list[int]) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request, in arrival order."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        plen = rng.randint(8, 256)
        olen = min(256, max(1, int(round(rng.expovariate(1 / 64)))))
        start = rng.randrange(len(vocab_ids))
        ids = (vocab_ids[start:] + vocab_ids)[:plen]
        out.append((ids, olen))
    return out


def padding_waste(reqs: list[tuple[list[int], int]], group: int = GROUP) -> dict:
    """Token slots a static batcher computes vs the useful ones (prefill and decode separately)."""
    pre_slots = pre_useful = dec_slots = dec_useful = 0
    for g in range(0, len(reqs), group):
        batch = reqs[g:g + group]
        p_max, o_max = max(len(p) for p, _ in batch), max(o for _, o in batch)
        pre_slots += len(batch) * p_max
        pre_useful += sum(len(p) for p, _ in batch)
        dec_slots += len(batch) * o_max
        dec_useful += sum(o for _, o in batch)
    total_slots, useful = pre_slots + dec_slots, pre_useful + dec_useful
    return {"prefill_waste": 1 - pre_useful / pre_slots, "decode_waste": 1 - dec_useful / dec_slots,
            "total_waste": 1 - useful / total_slots, "ceiling_speedup": total_slots / useful,
            "decode_ceiling_speedup": dec_slots / dec_useful}


def run_engine(model_dir, reqs, options: dict) -> dict:
    from backend import LLM, SamplingParams

    llm = LLM(str(model_dir), **options)
    llm.generate([reqs[0][0][:8]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for _, o in reqs]
    before = llm.engine.stats()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([p for p, _ in reqs], params)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    after = llm.engine.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(o for _, o in reqs), "ignore_eos: every request produces exactly its length"
    return {"seconds": elapsed, "output_tokens": tokens, "output_throughput": tokens / elapsed,
            "cpu_seconds": cpu, "cpu_throughput": tokens / cpu, "requests": len(reqs),
            "num_preemptions": after.num_preemptions - before.num_preemptions,
            "outputs": {i: o.outputs[0].token_ids for i, o in enumerate(outs)}}


def _hf_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    return model


def run_hf_sequential(model, reqs, sample: list[int], pad_id: int) -> dict:
    """One request at a time on a seeded sample; time extrapolated to all requests by tokens."""
    import torch

    outputs = {}
    with torch.inference_mode():
        model.generate(torch.tensor([reqs[0][0][:8]]), max_new_tokens=2, do_sample=False, pad_token_id=pad_id)
        t0 = time.perf_counter()
        for i in sample:
            ids, olen = reqs[i]
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=olen, min_new_tokens=olen, do_sample=False, pad_token_id=pad_id)
            outputs[i] = out[0, len(ids):].tolist()
        elapsed = time.perf_counter() - t0
    tokens = sum(reqs[i][1] for i in sample)
    total = sum(o for _, o in reqs)
    return {"seconds_measured": elapsed, "sampled_requests": len(sample), "output_tokens_measured": tokens,
            "output_throughput": tokens / elapsed, "extrapolated": len(sample) < len(reqs),
            "seconds": elapsed * total / tokens, "outputs": outputs}


def run_static(model, reqs, groups: list[int], pad_id: int) -> dict:
    """Left-padded groups of 16 in arrival order; each decodes to its longest output."""
    import torch

    elapsed = useful = cpu = 0.0
    with torch.inference_mode():
        for g in groups:
            batch = reqs[g * GROUP:(g + 1) * GROUP]
            width = max(len(p) for p, _ in batch)
            o_max = max(o for _, o in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for r, (p, _) in enumerate(batch):
                ids[r, width - len(p):] = torch.tensor(p)
                mask[r, width - len(p):] = 1
            t0, c0 = time.perf_counter(), time.process_time()
            model.generate(ids, attention_mask=mask, max_new_tokens=o_max, min_new_tokens=o_max,
                           do_sample=False, pad_token_id=pad_id)
            elapsed += time.perf_counter() - t0
            cpu += time.process_time() - c0
            useful += sum(o for _, o in batch)
    n_groups = math.ceil(len(reqs) / GROUP)
    total = sum(o for _, o in reqs)
    return {"seconds_measured": elapsed, "sampled_groups": len(groups), "groups": n_groups,
            "output_tokens_measured": useful, "output_throughput": useful / elapsed,
            "cpu_seconds_measured": cpu, "cpu_throughput": useful / cpu,
            "extrapolated": len(groups) < n_groups, "seconds": elapsed * total / useful}


def bench_model(name: str, args) -> dict:
    import torch
    from transformers import PreTrainedTokenizerFast

    from load.workloads import _corpus_ids

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(name)
    tok = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    reqs = make_requests(args.num_requests, args.seed, _corpus_ids())
    rng = random.Random(args.seed + 1)
    hf_sample = sorted(rng.sample(range(len(reqs)), min(args.hf_sample, len(reqs))))
    n_groups = math.ceil(len(reqs) / GROUP)
    static_groups = sorted(rng.sample(range(n_groups), min(args.static_groups, n_groups)))
    options = {"num_threads": args.threads, **engine_options(name, args.engine_option)}
    options = {k: (int(v) if str(v).isdigit() else v) for k, v in options.items() if v is not None}

    print(f"[{name}] engine: {len(reqs)} requests", flush=True)
    engine = run_engine(model_dir, reqs, options)
    model = _hf_model(model_dir)
    print(f"[{name}] HF sequential: {len(hf_sample)} sampled requests", flush=True)
    hf = run_hf_sequential(model, reqs, hf_sample, tok.pad_token_id)
    print(f"[{name}] static batching: {len(static_groups)} of {n_groups} groups", flush=True)
    static = run_static(model, reqs, static_groups, tok.pad_token_id)
    same = sum(engine["outputs"][i] == hf["outputs"][i] for i in hf_sample)
    del engine["outputs"], hf["outputs"]
    return {
        "model": name, "engine_options": options, "threads": torch.get_num_threads(),
        "total_output_tokens": sum(o for _, o in reqs),
        "mean_prompt_len": sum(len(p) for p, _ in reqs) / len(reqs),
        "mean_output_len": sum(o for _, o in reqs) / len(reqs),
        "engine": engine, "hf_sequential": hf, "static": static,
        "static_padding": padding_waste(reqs),
        "greedy_outputs_equal_hf": f"{same}/{len(hf_sample)}",
        "ratio_engine_vs_hf_sequential": engine["output_throughput"] / hf["output_throughput"],
        "ratio_engine_vs_static": engine["output_throughput"] / static["output_throughput"],
        # tokens per CPU second: robust to other work on a shared machine (with --threads 1)
        "ratio_engine_vs_static_cpu": engine["cpu_throughput"] / static["cpu_throughput"],
    }


def markdown(results: list[dict]) -> str:
    rows = ["| model | engine tok/s | HF one-by-one tok/s | static-16 tok/s | engine / HF | engine / static "
            "| engine / static per CPU s | static padding waste (ceiling) | greedy = HF |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        hf, st, pad = r["hf_sequential"], r["static"], r["static_padding"]
        rows.append(
            f"| {r['model']} | {r['engine']['output_throughput']:.0f} | {hf['output_throughput']:.1f}"
            f"{' (sample ' + str(hf['sampled_requests']) + ')' if hf['extrapolated'] else ''} "
            f"| {st['output_throughput']:.0f}{' (' + str(st['sampled_groups']) + ' groups)' if st['extrapolated'] else ''} "
            f"| {r['ratio_engine_vs_hf_sequential']:.1f}x | {r['ratio_engine_vs_static']:.2f}x "
            f"| {r['ratio_engine_vs_static_cpu']:.2f}x "
            f"| {pad['total_waste']:.0%} (≤ {pad['ceiling_speedup']:.2f}x) | {r['greedy_outputs_equal_hf']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m load.bench_offline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["bench-15m", "bench-110m"])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-sample", type=int, default=32, help="requests HF runs one by one (extrapolated)")
    p.add_argument("--static-groups", type=int, default=8,
                   help="seeded sample of the 16 static groups that runs (extrapolated by tokens)")
    p.add_argument("--threads", type=int, default=None, help="torch threads for every contender")
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default=str(RESULTS / "offline.json"))
    p.add_argument("--img", default=str(ROOT / "docs" / "img" / "offline.png"))
    args = p.parse_args(argv)

    results = [bench_model(m, args) for m in args.models]
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"command": "python -m load.bench_offline " + " ".join(sys.argv[1:] if argv is None else argv),
           "results": results}
    out.write_text(json.dumps(json_safe(doc), indent=1))
    table = markdown(results)
    print(table)
    out.with_suffix(".md").write_text(table + "\n")
    from load.plots import plot_bars

    plot_bars({r["model"]: {"engine": r["engine"]["output_throughput"],
                            "static batching (16)": r["static"]["output_throughput"],
                            "HF one at a time": r["hf_sequential"]["output_throughput"]} for r in results},
              args.img, ylabel="output tokens/s", title=f"Offline throughput ({args.num_requests} requests, CPU)", log=True)
    print(f"wrote {out} and {args.img}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
