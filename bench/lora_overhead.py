"""Unmerged LoRA serving against a merged base, side by side in one run (issue 31).

    python -m bench.lora_overhead --model models/default [--streams 16] [--adapters 8]
        [--config 16:q_proj,v_proj --config 8:all] [--max-tokens 128] [--rounds 3] [--work DIR]

``--adapters`` seeded PEFT adapters per ``--config`` (``RANK:TARGETS``, ``all`` = the seven
projections) are written with peft into ``--work``; adapter 0 of the first config is merged into
the base weights (PEFT ``merge_and_unload``) and saved as the "merged" model, the way a fine-tune
ships today. Each round runs the same ``--streams`` greedy requests (``--max-tokens`` each, EOS
ignored) once on the merged model, all on its one set of weights, and once per config on the
base model with the adapters unmerged, stream i on adapter i % adapters, all at once in one batch.
Rounds alternate the engines so a noisy neighbour hits them alike. Prints tokens/s per engine
(median over rounds) and overhead = 1 - unmerged / merged (issue 31 asks for at most 25 %), and
how many of the unmerged steps' adapter rows ran in the fused C step.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import tempfile
import time

import torch

from backend import LLM, SamplingParams
from backend.lora.adapter import TARGETS

PROMPTS = ["Write a short poem about the sea.", "What are three good habits for staying healthy?",
           "Explain in a few sentences why the sky is blue.", "Give me an idea for a birthday party.",
           "Summarize how a paged KV cache works.", "List five fruits and their colours.",
           "Describe a quiet morning in a small town.", "Why do leaves change colour in autumn?"]


def parse_config(text: str) -> tuple[int, list[str]]:
    rank, _, targets = text.partition(":")
    names = list(TARGETS) if targets in ("", "all") else targets.split(",")
    if not rank.isdigit() or not set(names) <= set(TARGETS):
        raise argparse.ArgumentTypeError(f"--config RANK:TARGETS (targets among {', '.join(TARGETS)} or all), got {text!r}")
    return int(rank), names


def make_adapters(model: pathlib.Path, out: pathlib.Path, rank: int, targets: list[str], count: int,
                  seed: int) -> list[pathlib.Path]:
    """``count`` PEFT adapters of one shape, A and B from seeds (B non-zero: the products count)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dirs = [out / f"r{rank}-{'-'.join(targets)}-{seed}-{i}" for i in range(count)]
    if all((d / "adapter_model.safetensors").exists() for d in dirs):
        return dirs                             # written by an earlier run into the same --work
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                 lora_dropout=0.0, bias="none"))
    for i, d in enumerate(dirs):
        g = torch.Generator().manual_seed(seed + i)
        with torch.no_grad():
            for name, p in sorted(peft_model.named_parameters()):
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.01)
        peft_model.save_pretrained(d)
    return dirs


def merged_model(model: pathlib.Path, adapter: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """The base with ``adapter`` merged into its weights, tokenizer files alongside."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    stamp = out / "merged-from"
    if (out / "model.safetensors").exists() and stamp.exists() and stamp.read_text() == str(adapter):
        return out
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    PeftModel.from_pretrained(base, adapter).merge_and_unload().save_pretrained(out)
    for f in model.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("generation_config.json", "special_tokens_map.json"):
            shutil.copy(f, out / f.name)
    stamp.write_text(str(adapter))
    return out


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def c_rows() -> int:
    """Adapter rows x projections the fused C step has updated in this process (lora_cpu.c)."""
    from backend.lora.fused import rows_done
    return rows_done()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/default")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--config", type=parse_config, action="append",
                    help="RANK:TARGETS of the unmerged adapters (repeatable; default 16:q_proj,v_proj and 8:all)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--work", default=None, help="folder for the adapters and the merged model (default: a temp dir)")
    a = ap.parse_args()
    configs = a.config or [parse_config("16:q_proj,v_proj"), parse_config("8:all")]
    model = pathlib.Path(a.model)
    work = pathlib.Path(a.work or tempfile.mkdtemp(prefix="lora_overhead-"))
    work.mkdir(parents=True, exist_ok=True)
    sets = {f"unmerged r{r} {'all' if t == list(TARGETS) else ','.join(t)}":
            make_adapters(model, work, r, t, a.adapters, seed=100 * (k + 1)) for k, (r, t) in enumerate(configs)}
    merged = merged_model(model, next(iter(sets.values()))[0], work / "merged")
    opts = dict(max_num_seqs=a.streams, num_threads=a.threads)
    engines = {"merged": LLM(str(merged), **opts)}
    for label, dirs in sets.items():
        engines[label] = LLM(str(model), max_loras=a.adapters, max_lora_rank=max(r for r, _ in configs),
                             lora_modules={f"a{i}": str(d) for i, d in enumerate(dirs)}, **opts)
    tok = engines["merged"].tokenizer
    prompts = [tok.encode(PROMPTS[i % len(PROMPTS)]) for i in range(a.streams)]
    greedy = dict(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    params = {label: [SamplingParams(**greedy, lora=None if label == "merged" else f"a{i % a.adapters}")
                      for i in range(a.streams)] for label in engines}
    for label, llm in engines.items():           # warm-up: kernels built, adapters read, pools touched
        run(llm, prompts, [SamplingParams(**{**greedy, "max_tokens": 4}, lora=p.lora) for p in params[label]])
    tps: dict[str, list[float]] = {label: [] for label in engines}
    rows0 = c_rows()
    for _ in range(a.rounds):
        for label, llm in engines.items():
            secs, toks = run(llm, prompts, params[label])
            tps[label].append(toks / secs)
    med = {label: statistics.median(v) for label, v in tps.items()}
    result = {"model": str(model), "streams": a.streams, "adapters": a.adapters, "max_tokens": a.max_tokens,
              "rounds": a.rounds, "threads": torch.get_num_threads(), "c_step_adapter_rows": c_rows() - rows0,
              "tokens_per_s": {k: round(v, 1) for k, v in med.items()},
              "overhead": {k: round(1 - v / med["merged"], 3) for k, v in med.items() if k != "merged"}}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
