"""Weight-only quantization, side by side in one run: quality, speed and weight memory.

    python -m load.bench_quant quality [--model models/default] [--methods none int8 int4 int4@128]
    python -m load.bench_quant speed   [--model models/default] [--streams 1 16] [--tokens 64]
    python -m load.bench_quant kernels          # one GEMM: fp32 F.linear vs our C vs torch packed

quality: perplexity on the English (ASCII) lines of backend/assets/corpus.txt (fixed since the
foundation commit; windows of 512 tokens, every token scored), and greedy agreement with fp32 over
20 prompts x 64 tokens (the share of positions whose token equals fp32's, and the mean length of
the common prefix). speed: offline LLM.generate tok/s (greedy, ignore_eos) at each stream count,
and the model's resident weight bytes (parameters as loaded). Results go to stdout as markdown and
to ``--json``. Numbers and commands are recorded in docs/quantization.md.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import pathlib
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORPUS = ROOT / "backend" / "assets" / "corpus.txt"
WINDOW = 512


def english_text() -> str:
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    return "\n".join(ln for ln in lines if ln.strip() and ln.isascii())


def prompts(n: int = 20) -> list[str]:
    lines = [ln for ln in english_text().splitlines() if len(ln.split()) >= 6]
    return [" ".join(ln.split()[:8]) for ln in lines[:n]]


def parse_spec(spec: str) -> dict:
    """``int4@128:bfloat16`` -> engine options (method, then @group size, then :dtype); a ``+head``
    after the method also quantizes the LM head (``int8+head``: quant_lm_head)."""
    rest, _, dtype = spec.partition(":")
    head = rest.endswith("+head") or "+head@" in rest
    method, _, group = rest.replace("+head", "").partition("@")
    return {"quantization": method, "dtype": dtype or "float32", "quant_group_size": int(group or 32),
            "quant_lm_head": head}


def _runner(model: str, spec: str):
    from backend.config import EngineArgs
    from backend.model.runner import ModelRunner

    return ModelRunner(model, EngineArgs(**parse_spec(spec), num_kv_blocks=WINDOW // 16 + 2))


@torch.inference_mode()
def perplexity(runner, ids: list[int]) -> float:
    from backend.model.batch_builder import SeqChunk, build_batch

    nll, count = 0.0, 0
    table = list(range(runner.num_blocks))
    for start in range(0, len(ids) - 1, WINDOW):
        chunk = ids[start:start + WINDOW + 1]
        batch = build_batch([SeqChunk(chunk[:-1], 0, table, all_logits=True)], 16)
        logits = runner.execute(batch)
        target = torch.tensor(chunk[1:])
        nll += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        count += len(target)
    return math.exp(nll / count)


def greedy(model: str, spec: str, texts: list[str], tokens: int) -> list[list[int]]:
    from backend import LLM, SamplingParams

    llm = LLM(model, **parse_spec(spec))
    outs = llm.generate(texts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    total = sum(len(r) for r in ref)
    prefix = []
    for r, g in zip(ref, got):
        n = 0
        while n < min(len(r), len(g)) and r[n] == g[n]:
            n += 1
        prefix.append(n)
    return {"identical_tokens": same / total, "mean_common_prefix": sum(prefix) / len(prefix)}


def quality(a) -> list[dict]:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(a.model)
    ids = tok.encode(english_text())
    texts = prompts()
    rows, ref = [], None
    for method in a.methods:             # specs: none, int8, int4, int4@128, none:bfloat16 ...
        t0 = time.perf_counter()
        runner = _runner(a.model, method)
        load_s = time.perf_counter() - t0
        ppl = perplexity(runner, ids)
        wbytes = runner.model.quantization["weight_bytes"]
        del runner
        gc.collect()
        outs = greedy(a.model, method, texts, a.tokens)
        ref = outs if ref is None else ref
        rows.append({"method": method, "perplexity": ppl, "tokens_scored": len(ids) - 1,
                     "weight_bytes": wbytes, "load_s": load_s, **agreement(ref, outs)})
        gc.collect()
    base = rows[0]["perplexity"]
    for r in rows:
        r["ppl_increase"] = r["perplexity"] / base - 1
    return rows


def speed(a) -> list[dict]:
    """Every variant loaded at once, then ``--rounds`` rounds that time each variant in turn; the
    best round counts. On a shared 2-core host a single pass per variant mostly measures who else
    was running at the time; interleaving puts every variant through the same conditions."""
    from backend import LLM, SamplingParams

    texts = prompts(max(a.streams))
    params = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    llms, rows = {}, {}
    for spec in a.methods:
        llms[spec] = LLM(a.model, **parse_spec(spec))
        llms[spec].generate(texts[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        rows[spec] = {"method": spec, "weight_bytes": llms[spec].engine.runner.model.quantization["weight_bytes"]}
    for _ in range(a.rounds):
        for n in a.streams:
            for spec, llm in llms.items():
                t0, c0 = time.perf_counter(), time.process_time()
                llm.generate(texts[:n], params)
                rate = n * a.tokens / (time.perf_counter() - t0)
                cpu_rate = n * a.tokens / (time.process_time() - c0)     # per CPU second: robust to load
                rows[spec][f"tok_s_{n}"] = max(rate, rows[spec].get(f"tok_s_{n}", 0.0))
                rows[spec][f"cpu_tok_s_{n}"] = max(cpu_rate, rows[spec].get(f"cpu_tok_s_{n}", 0.0))
    base = rows[a.methods[0]]
    for r in rows.values():
        for n in a.streams:
            r[f"x_{n}"] = r[f"tok_s_{n}"] / base[f"tok_s_{n}"]
            r[f"cpu_x_{n}"] = r[f"cpu_tok_s_{n}"] / base[f"cpu_tok_s_{n}"]
    return list(rows.values())


def kernels(a) -> list[dict]:
    import torch.nn.functional as F

    from backend.quant import cpu, layout

    def bench(fn, n=20, rounds=5):
        fn()
        best = float("inf")
        for _ in range(rounds):                  # best of rounds: robust to a contended host
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - t0) / n * 1e6)
        return best

    rows = []
    for n_out, k in ((960, 576), (3072, 576), (576, 1536)):
        w = torch.randn(n_out, k)
        q8, q4 = layout.quantize(w, "int8", 32), layout.quantize(w, "int4", 32)
        i8 = q8.qweight
        s8 = q8.scales.float().flatten()
        w4 = torch.randint(0, 16, (n_out, k), dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w4, 1)
        sz = torch.rand(k // 64, n_out, 2)
        for m in (1, 16):
            x = torch.randn(m, k)
            xb = x.bfloat16()
            rows.append({"N": n_out, "K": k, "M": m,
                         "fp32_linear_us": bench(lambda: F.linear(x, w)),
                         "c_int8_us": bench(lambda: cpu.gemm(x, "int8", q8.qweight, q8.scales, None, q8.group_size, k, None)),
                         "c_int4_us": bench(lambda: cpu.gemm(x, "int4", q4.qweight, q4.scales, q4.zeros, 32, k, None)),
                         "torch_int8pack_us": bench(lambda: torch._weight_int8pack_mm(x, i8, s8)),
                         "torch_int4pack_fp32_us": bench(lambda: torch._weight_int4pack_mm_for_cpu(x, packed, 64, sz)),
                         "torch_int4pack_bf16_us": bench(lambda: torch._weight_int4pack_mm_for_cpu(xb, packed, 64, sz.bfloat16()))})
    return rows


def markdown(rows: list[dict]) -> str:
    keys = list(rows[0])
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)   # noqa: E731
    return "\n".join(["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
                     + ["| " + " | ".join(fmt(r.get(k)) for k in keys) + " |" for r in rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("quality", "speed", "kernels"))
    ap.add_argument("--model", default=str(ROOT / "models" / "default"))
    ap.add_argument("--methods", nargs="+", default=None)
    ap.add_argument("--streams", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.methods is None:
        a.methods = ["none", "int8", "int4"] if a.what == "quality" else ["none", "none:bfloat16", "int8", "int4"]
    rows = {"quality": quality, "speed": speed, "kernels": kernels}[a.what](a)
    print(markdown(rows))
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
