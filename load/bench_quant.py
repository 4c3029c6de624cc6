"""Weight-only quantization, side by side in one run: quality, speed and weight memory.

    python -m load.bench_quant quality [--model models/default] [--methods none int8 int4 int4@128]
    python -m load.bench_quant speed   [--model models/default] [--streams 1 16] [--tokens 64]
    python -m load.bench_quant kernels [--threads 1] [--ms 1 16] [--shapes 576x576]   # one GEMM per kernel
    python -m load.bench_quant step [--batch 2 4 8 16] [--prefill 64 192 512]  # the model's step

A method spec ``int8!f32a`` (speed) is int8 with the int16-activation kernel switched off (the
weight-only C loops for every M; backend/quant/cpu.py), timed in the same process as ``int8``.

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
    """``int4@128:bfloat16`` -> engine options (method, then @group size, then :dtype); ``+head`` /
    ``-head`` after the method quantizes the LM head or keeps it float (``quant_lm_head``; neither:
    the engine's default, on with int8)."""
    spec = spec.replace("!f32a", "")             # speed: int8 with fp32 activations (see speed())
    rest, _, dtype = spec.partition(":")
    head = True if "+head" in rest else False if "-head" in rest else None
    method, _, group = rest.replace("+head", "").replace("-head", "").partition("@")
    return {"quantization": method, "dtype": dtype or "float32", "quant_group_size": int(group or 32),
            "quant_lm_head": head}


def _runner(model: str, spec: str):
    from backend.config import EngineConfig
    from backend.model.runner import ModelRunner

    return ModelRunner(model, EngineConfig(**parse_spec(spec), num_kv_blocks=WINDOW // 16 + 2))


@torch.inference_mode()
def perplexity(runner, ids: list[int]) -> float:
    from backend.model.runner import SeqChunk, build_batch

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
    from backend.quant import cpu as qcpu

    lib = qcpu.library()
    default = lib.w8_a16_min_m() if lib is not None else 0
    for _ in range(a.rounds):
        for n in a.streams:
            for spec, llm in llms.items():
                if lib is not None:            # "int8!f32a": the same int8 model, weight-only GEMMs
                    lib.w8_set_a16_min_m(0 if spec.endswith("!f32a") else default)
                t0, c0 = time.perf_counter(), time.process_time()
                llm.generate(texts[:n], params)
                rate = n * a.tokens / (time.perf_counter() - t0)
                cpu_rate = n * a.tokens / (time.process_time() - c0)     # per CPU second: robust to load
                rows[spec][f"tok_s_{n}"] = max(rate, rows[spec].get(f"tok_s_{n}", 0.0))
                rows[spec][f"cpu_tok_s_{n}"] = max(cpu_rate, rows[spec].get(f"cpu_tok_s_{n}", 0.0))
    if lib is not None:
        lib.w8_set_a16_min_m(default)
    base = rows[a.methods[0]]
    for r in rows.values():
        for n in a.streams:
            r[f"x_{n}"] = r[f"tok_s_{n}"] / base[f"tok_s_{n}"]
            r[f"cpu_x_{n}"] = r[f"cpu_tok_s_{n}"] / base[f"cpu_tok_s_{n}"]
    return list(rows.values())


def kernels(a) -> list[dict]:
    """One GEMM per shape and M, µs per call (best of 5 rounds): fp32 ``F.linear`` (MKL), int8
    dequantize + ``F.linear`` (``blas``), the int8 weight-only C loops (``f32a``), int8 x int16
    activations (``a16``), and int4's C loops; ``--torch-packed`` adds torch's int8/int4 packed
    kernels (slow on this AVX2 torch, docs/quantization.md). Default shapes: SmolLM2-135M's
    projections (qkv split as 576 x 576 q and 192 x 576 k/v, gate/up 1536 x 576, down 576 x 1536) and
    its 49152 x 576 lm_head. The weight stays in cache between calls (except the lm_head), so this
    is each kernel's arithmetic rate; the model's step (``step``) is the end-to-end check."""
    import torch.nn.functional as F

    from backend.quant import cpu, layout

    def bench(fn, rounds=5):
        fn()
        t0 = time.perf_counter()
        fn()
        n = max(1, min(20, int(0.05 / max(time.perf_counter() - t0, 1e-6))))
        best = float("inf")
        for _ in range(rounds):                  # best of rounds: robust to a contended host
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - t0) / n * 1e6)
        return best

    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes]
    rows = []
    for n_out, k in shapes:
        w = torch.randn(n_out, k)
        q8, q4 = layout.quantize_int8(w, a.int8_group), layout.quantize(w, "int4", 32)
        for m in a.ms:
            if n_out * m > 49152 * 64:
                continue
            x = torch.randn(m, k)
            g8 = lambda kern: bench(lambda: cpu.gemm(x, "int8", q8.qweight, q8.scales, None, q8.group_size, k, None,  # noqa: E731
                                                     kernel=kern))
            r = {"N": n_out, "K": k, "M": m, "fp32_linear_us": bench(lambda: F.linear(x, w)),
                 "int8_blas_us": g8("blas"), "int8_f32a_us": g8("f32a"), "int8_a16_us": g8("a16"),
                 "int4_c_us": bench(lambda: cpu.gemm(x, "int4", q4.qweight, q4.scales, q4.zeros, 32, k, None))}
            r["a16_vs_f32a"] = r["int8_f32a_us"] / r["int8_a16_us"]
            r["a16_vs_fp32"] = r["fp32_linear_us"] / r["int8_a16_us"]
            if a.torch_packed:
                i8, s8 = q8.qweight, q8.scales.float().flatten()
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                    torch.randint(0, 16, (n_out, k), dtype=torch.int32), 1)
                sz = torch.rand(k // 64, n_out, 2)
                r["torch_int8pack_us"] = bench(lambda: torch._weight_int8pack_mm(x, i8, s8))
                r["torch_int4pack_fp32_us"] = bench(lambda: torch._weight_int4pack_mm_for_cpu(x, packed, 64, sz))
            rows.append(r)
            print(r, flush=True)
    return rows


def step(a) -> list[dict]:
    """The real model's step, fp32 vs int8 with int16 activations (``a16``) vs int8 weight-only
    (``f32a``), in one process: decode steps at each ``--batch`` (M = batch rows per projection)
    and single-sequence prefill chunks of each ``--prefill`` length, variants round-robin (the int8
    variants share one runner: the C library's w8_set_a16_min_m switches them), best process CPU
    time of ``--rounds``."""
    import random

    from backend.config import EngineConfig
    from backend.model.runner import SeqChunk, build_batch
    from backend.model.runner import ModelRunner
    from backend.quant import cpu

    lib, bs, ctx = cpu.library(), 16, a.context
    longest = max([*a.prefill, ctx + a.rounds + 2])
    per_seq = -(-longest // bs) + 1
    nseq = max(a.batch)
    args = dict(block_size=bs, num_kv_blocks=nseq * per_seq, num_threads=a.threads or 1)
    fp32 = ModelRunner(a.model, EngineConfig(**args))
    q8 = ModelRunner(a.model, EngineConfig(quantization="int8", quant_lm_head=a.head, **args))
    rng = random.Random(0)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(nseq)]
    prompts = [[rng.randrange(fp32.info.vocab_size) for _ in range(longest)] for _ in range(nseq)]
    variants = {"fp32": (fp32, None), "int8_a16": (q8, cpu.A16_MIN_M), "int8_f32a": (q8, 0)}
    default = lib.w8_a16_min_m()
    for r in (fp32, q8):
        for i in range(0, nseq, 8):
            r.execute(build_batch([SeqChunk(p[:ctx], 0, t) for p, t in zip(prompts[i:i + 8], tables[i:i + 8])], bs))
    jobs = [("decode", b) for b in a.batch] + [("prefill", n) for n in a.prefill]
    rows = []
    try:
        for kind, size in jobs:
            if kind == "decode":
                batch = build_batch([SeqChunk([p[ctx]], ctx, t) for p, t in zip(prompts[:size], tables)], bs)
            else:
                batch = build_batch([SeqChunk(prompts[0][:size], 0, tables[0])], bs)
            best, fused = {}, {}
            for rnd in range(a.rounds + 1):                  # round 0: warm-up
                for name, (r, min_m) in variants.items():
                    if min_m is not None:
                        lib.w8_set_a16_min_m(min_m)
                    c0 = time.process_time()
                    r.execute(batch)
                    c = time.process_time() - c0
                    if rnd:
                        best[name] = min(c, best.get(name, float("inf")))
                    fused[name] = r.fused is not None and r.fused.accepts(batch.input_ids.shape[0], batch.seq_lens.shape[0])
            row = {"step": kind, "tokens": size}
            for name in variants:
                row[f"{name}_ms"] = 1e3 * best[name]
            row["a16_vs_f32a"] = best["int8_f32a"] / best["int8_a16"]
            row["a16_vs_fp32"] = best["fp32"] / best["int8_a16"]
            row["f32a_vs_fp32"] = best["fp32"] / best["int8_f32a"]
            row["int8_fused"] = fused["int8_a16"]
            rows.append(row)
            print(row, flush=True)
    finally:
        lib.w8_set_a16_min_m(default)
    return rows


def markdown(rows: list[dict]) -> str:
    keys = list(rows[0])
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)   # noqa: E731
    return "\n".join(["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
                     + ["| " + " | ".join(fmt(r.get(k)) for k in keys) + " |" for r in rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("quality", "speed", "kernels", "step"))
    ap.add_argument("--model", default=str(ROOT / "models" / "default"))
    ap.add_argument("--methods", nargs="+", default=None)
    ap.add_argument("--streams", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch", nargs="+", type=int, default=[2, 4, 8, 16], help="step: decode batches")
    ap.add_argument("--prefill", nargs="+", type=int, default=[64, 192, 512], help="step: prefill lengths")
    ap.add_argument("--context", type=int, default=128, help="step: decode context")
    ap.add_argument("--head", action="store_true", help="step: quant_lm_head for the int8 runner")
    ap.add_argument("--shapes", nargs="+", default=["576x576", "192x576", "1536x576", "576x1536", "49152x576"],
                    help="kernels: N x K")
    ap.add_argument("--ms", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64, 128, 512], help="kernels: M")
    ap.add_argument("--torch-packed", action="store_true", help="kernels: torch's packed int8/int4 too")
    ap.add_argument("--int8-group", type=int, default=None, help="kernels: int8 group size (default: per channel; "
                    "32: GGUF Q8_0's layout)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.methods is None:
        a.methods = ["none", "int8", "int4"] if a.what == "quality" else ["none", "none:bfloat16", "int8", "int4"]
    rows = {"quality": quality, "speed": speed, "kernels": kernels, "step": step}[a.what](a)
    print(markdown(rows))
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
