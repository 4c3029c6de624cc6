#!/usr/bin/env python3
"""One prepared check for a machine with a CUDA GPU (torch + triton installed, no internet).

    python scripts/gpu_check.py [--model-dir DIR] [--budget 470] [--skip tests,attention,engine]

1. tests      pytest tests/kernels compiled natively on the GPU (KERNELS_TEST_DEVICE=cuda)
2. attention  paged_attention vs the torch reference and vs SDPA on pre-gathered KV, plus a
              correctness sweep that needs no pytest
3. engine     backend.LLM decode throughput, batch 1..256, bench-110m in bf16 (triton, then torch)

Each part runs in a child process under its own time limit, so a hang or crash in one is
reported and the rest still run; the whole check stays within --budget seconds (default
470, under 8 minutes).  Children print ``RESULT {json}`` lines; the summary table is
printed at the end and everything is written to $OUT/gpu_check (or out/gpu_check).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMITS = {"tests": 170, "attention": 100}   # seconds; the engine part gets what is left


def result(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


# --------------------------------------------------------------------------- part 2: attention
def _bench(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=40)


def _paged_batch(q_lens, seq_lens, *, hq=32, hkv=8, d=128, bs=16, dtype=None, seed=0):
    import torch
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(nblk) + 4
    kv = torch.randn(2, num_blocks, bs, hkv, d, generator=g).to(dtype).cuda()
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(seq_lens), max(nblk), dtype=torch.int32)
    start = 0
    for s, n in enumerate(nblk):
        tables[s, :n] = perm[start:start + n].to(torch.int32)
        start += n
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(cu[-1]), hq, d, generator=g).to(dtype).cuda()
    return dict(query=q, k_cache=kv[0], v_cache=kv[1], block_tables=tables.cuda(),
                cu_seqlens_q=cu.cuda(), seq_lens=torch.tensor(seq_lens, dtype=torch.int32).cuda(),
                scale=d ** -0.5)


def part_attention(deadline: float) -> None:
    import torch
    import torch.nn.functional as F

    import kernels
    result(part="attention", event="env", gpu=torch.cuda.get_device_name(), torch=torch.__version__,
           triton=__import__("triton").__version__, triton_available=kernels.triton_available("cuda"))
    # Correctness sweep (no pytest needed): dtype x GQA group x head dim x split.
    for dtype in (torch.float32, torch.bfloat16):
        for group in (1, 4, 8):
            for d in (64, 128):
                for splits in (1, 4):
                    if time.time() > deadline - 30:
                        break
                    b = _paged_batch([1, 70, 1, 13, 1], [37, 110, 300, 13, 1000], hq=2 * group, hkv=2,
                                     d=d, bs=16, dtype=dtype, seed=group + d)
                    out = kernels.paged_attention(**b, num_kv_splits=splits).float()
                    ref = kernels.paged_attention_ref(**{k: (v.float() if k in ("query", "k_cache", "v_cache")
                                                             else v) for k, v in b.items()})
                    err = (out - ref).abs().max().item()
                    tol = 1e-3 if dtype == torch.float32 else 3e-2
                    result(part="attention", event="check", dtype=str(dtype)[6:], group=group, head_dim=d,
                           splits=splits, max_err=err, ok=bool(err < tol))
    # Timing: Llama-8B-like heads (32 q, 8 kv, dim 128), bf16, block size 16.
    shapes = [("decode B=1 ctx=8192 auto-split", [1], [8192], {}),
              ("decode B=1 ctx=8192 no split", [1], [8192], {"num_kv_splits": 1}),
              ("decode B=64 ctx=1024", [1] * 64, [1024] * 64, {}),
              ("decode B=256 ctx=512", [1] * 256, [512] * 256, {}),
              ("prefill 1x2048", [2048], [2048], {}),
              ("chunk 512 over 1536 + 63 decodes", [512] + [1] * 63, [2048] + [1024] * 63, {})]
    for name, q_lens, seq_lens, extra in shapes:
        if time.time() > deadline - 10:
            result(part="attention", event="skipped", shape=name)
            continue
        b = _paged_batch(q_lens, seq_lens, dtype=torch.bfloat16)
        out = torch.empty_like(b["query"])
        t_triton = _bench(lambda: kernels.paged_attention(**b, out=out, **extra))
        t_ref = _bench(lambda: kernels.paged_attention_ref(**b))
        # SDPA on KV already gathered into dense [B, H, S, D] (a floor for dense attention).
        t_sdpa = None
        if len(set(q_lens)) == 1 and len(set(seq_lens)) == 1:
            nb = b["seq_lens"].numel()
            ql, sl = b["query"].shape[0] // nb, int(b["seq_lens"][0])
            ids = b["block_tables"].long().flatten()
            k = b["k_cache"][ids].view(nb, -1, 8, 128)[:, :sl].transpose(1, 2).contiguous()
            v = b["v_cache"][ids].view(nb, -1, 8, 128)[:, :sl].transpose(1, 2).contiguous()
            k, v = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
            q = b["query"].view(nb, ql, 32, 128).transpose(1, 2)
            t_sdpa = _bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=ql > 1))
        kv_bytes = int(b["seq_lens"].sum()) * 8 * 128 * 2 * 2
        result(part="attention", event="time", shape=name, triton_ms=t_triton, ref_ms=t_ref,
               sdpa_dense_ms=t_sdpa, triton_kv_GBps=kv_bytes / t_triton / 1e6)


# --------------------------------------------------------------------------- part 3: engine
def _make_model(deadline: float) -> str:
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), "gpu_check_bench-110m")   # not under $OUT: 200+ MB
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    cmds = [[sys.executable, "-m", "triton_llm.cli", "make-model", "bench-110m", "--out", out],
            [os.path.join(ROOT, ".venv", "bin", "triton-llm"), "make-model", "bench-110m", "--out", out]]
    for cmd in cmds:
        if not os.path.exists(cmd[0]):
            continue
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=max(10, min(180, deadline - time.time() - 60)))
        if proc.returncode == 0:
            return out
        print(proc.stdout[-2000:], proc.stderr[-3000:], file=sys.stderr)
    raise RuntimeError("make-model bench-110m failed (see log)")


def part_engine(deadline: float, model_dir: str | None) -> None:
    import torch
    sys.path.insert(0, ROOT)
    model_dir = model_dir or _make_model(deadline)
    vocab = json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"]
    try:
        from backend import LLM, SamplingParams
    except ImportError as exc:   # engine not there yet: time the model runner's decode instead
        result(part="engine", event="error", backend="LLM", error=f"no backend.LLM ({exc}); runner bench")
        return _runner_bench(deadline, model_dir)
    rng = random.Random(0)
    prompt_len, new_tokens = 32, 64
    for attn in ("triton", "torch"):
        if time.time() > deadline - 30:
            result(part="engine", event="skipped", backend=attn)
            continue
        try:
            t0 = time.time()
            llm = LLM(model_dir, dtype="bfloat16", device="cuda", attention_backend=attn,
                      max_num_seqs=256, max_num_batched_tokens=8192, kv_cache_memory=8 << 30)
            greedy = lambda n: SamplingParams(max_tokens=n, ignore_eos=True, temperature=0)  # noqa: E731
            llm.generate([[rng.randrange(10, vocab) for _ in range(prompt_len)]] * 2, greedy(8))  # warm-up
            result(part="engine", event="load", backend=attn, seconds=time.time() - t0)
            for batch in (1, 8, 32, 64, 128, 256):
                if time.time() > deadline - 20:
                    result(part="engine", event="skipped", backend=attn, batch=batch)
                    continue
                prompts = lambda: [[rng.randrange(10, vocab) for _ in range(prompt_len)]  # noqa: E731
                                   for _ in range(batch)]
                t = time.perf_counter()
                llm.generate(prompts(), greedy(1))
                t_prefill = time.perf_counter() - t
                t = time.perf_counter()
                outs = llm.generate(prompts(), greedy(new_tokens))
                total = time.perf_counter() - t
                got = sum(len(getattr(o.outputs[0], "token_ids", ())) for o in outs)
                decode_s = max(total - t_prefill, 1e-9)
                result(part="engine", event="time", backend=attn, batch=batch, tokens=got,
                       total_s=total, decode_tok_s=batch * (new_tokens - 1) / decode_s,
                       ms_per_step=1000 * decode_s / (new_tokens - 1))
            del llm
            torch.cuda.empty_cache()
        except Exception as exc:  # report and go on with the other backend
            result(part="engine", event="error", backend=attn, error=f"{type(exc).__name__}: {exc}"[:500])


def _runner_bench(deadline: float, model_dir: str) -> None:
    """Decode steps straight on the ModelRunner (no scheduler), for when backend.LLM is missing."""
    import torch
    from backend.config import EngineConfig
    from backend.model.runner import SeqChunk, build_batch
    from backend.model.runner import ModelRunner
    context, steps, bs, max_batch = 32, 16, 16, 256
    per_seq = -(-(context + steps + 1) // bs)
    for attn in ("triton", "torch"):
        try:
            runner = ModelRunner(model_dir, EngineConfig(dtype="bfloat16", device="cuda", attention_backend=attn,
                                                       block_size=bs, num_kv_blocks=max_batch * per_seq))
            vocab = runner.info.vocab_size
            for batch in (1, 8, 32, 64, 128, 256):
                if time.time() > deadline - 20:
                    result(part="engine", event="skipped", backend=attn + "(runner)", batch=batch)
                    continue
                tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
                prompts = [[random.randrange(10, vocab) for _ in range(context)] for _ in range(batch)]
                for i in range(0, batch, 32):
                    runner.execute(build_batch([SeqChunk(p, 0, t) for p, t in
                                                zip(prompts[i:i + 32], tables[i:i + 32])], bs))
                last, times = [p[-1] for p in prompts], []
                for step in range(steps + 1):            # step 0 warms up
                    b = build_batch([SeqChunk([tok], context + step, t) for tok, t in zip(last, tables)], bs)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    last = runner.execute(b).argmax(-1).tolist()
                    times.append(time.perf_counter() - t0)
                ms = 1000 * sum(times[1:]) / steps
                result(part="engine", event="time", backend=attn + "(runner)", batch=batch, tokens=None,
                       total_s=None, decode_tok_s=batch * 1000 / ms, ms_per_step=ms)
            del runner
            torch.cuda.empty_cache()
        except Exception as exc:
            result(part="engine", event="error", backend=attn + "(runner)",
                   error=f"{type(exc).__name__}: {exc}"[:500])


# --------------------------------------------------------------------------- orchestration
def run_child(name: str, cmd: list[str], env: dict, timeout: float, log_dir: str) -> tuple[list, str]:
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        stdout, stderr, status = proc.stdout, proc.stderr, f"exit {proc.returncode}"
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        status = f"TIMEOUT after {timeout:.0f}s"
    with open(os.path.join(log_dir, f"{name}.log"), "w") as f:
        f.write(f"$ {' '.join(cmd)}\n{status}\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    rows = [json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")]
    print(f"[{name}] {status} in {time.time() - t0:.0f}s", flush=True)
    return rows, status + ("" if rows or name == "tests" else " | " + stderr.strip()[-600:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help="existing bench-110m checkpoint (else made)")
    ap.add_argument("--budget", type=float, default=470, help="seconds for the whole check")
    ap.add_argument("--skip", default="", help="comma list of parts to skip")
    args = ap.parse_args()
    if args.part == "attention":
        return part_attention(args.deadline) or 0
    if args.part == "engine":
        return part_engine(args.deadline, args.model_dir) or 0

    start = time.time()
    log_dir = os.path.join(os.environ.get("OUT") or os.path.join(ROOT, "out"), "gpu_check")
    os.makedirs(log_dir, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(KERNELS_TEST_DEVICE="cuda", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
               TRITON_DEFAULT_FP_FUSION=env.get("TRITON_DEFAULT_FP_FUSION", "1"))
    skip = set(filter(None, args.skip.split(",")))
    summary, rows = {}, []
    if "tests" not in skip:
        _, status = run_child("tests", [sys.executable, "-m", "pytest", "tests/kernels", "-q", "-rfE",
                                        "-p", "no:cacheprovider"], env, LIMITS["tests"], log_dir)
        tail = open(os.path.join(log_dir, "tests.log")).read().strip().splitlines()
        summary["tests"] = status + " | " + next((l for l in reversed(tail) if " in " in l), "?")
    for part in ("attention", "engine"):
        if part in skip:
            continue
        left = args.budget - (time.time() - start)
        limit = min(LIMITS.get(part, left), left - 5)
        if limit < 20:
            summary[part] = "skipped: out of time"
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--part", part,
               "--deadline", str(time.time() + limit - 5)]
        if args.model_dir:
            cmd += ["--model-dir", args.model_dir]
        got, summary[part] = run_child(part, cmd, env, limit, log_dir)
        rows += got
    json.dump({"summary": summary, "rows": rows}, open(os.path.join(log_dir, "results.json"), "w"), indent=1)
    print_table(summary, rows)
    print(f"total {time.time() - start:.0f}s; logs in {log_dir}")
    return 0


def print_table(summary: dict, rows: list) -> None:
    fmt = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
    print("\n== summary")
    for part, status in summary.items():
        print(f"{part:10s} {status}")
    checks = [r for r in rows if r.get("event") == "check"]
    if checks:
        bad = [r for r in checks if not r["ok"]]
        print(f"\n== attention correctness: {len(checks) - len(bad)}/{len(checks)} ok, worst err "
              f"{max(r['max_err'] for r in checks):.2e}" + "".join(f"\n  BAD {r}" for r in bad))
    times = [r for r in rows if r.get("part") == "attention" and r.get("event") == "time"]
    if times:
        print(f"\n== attention (bf16, 32 q / 8 kv heads, dim 128)\n{'shape':36s} {'triton ms':>10s} "
              f"{'ref ms':>9s} {'sdpa ms':>9s} {'KV GB/s':>8s}")
        for r in times:
            print(f"{r['shape']:36s} {fmt(r['triton_ms']):>10s} {fmt(r['ref_ms']):>9s} "
                  f"{fmt(r['sdpa_dense_ms']):>9s} {r['triton_kv_GBps']:8.0f}")
    eng = [r for r in rows if r.get("part") == "engine"]
    if eng:
        print(f"\n== engine decode, bench-110m bf16\n{'backend':8s} {'batch':>5s} {'tok/s':>9s} {'ms/step':>8s}")
        for r in eng:
            if r["event"] == "time":
                print(f"{r['backend']:8s} {r['batch']:5d} {r['decode_tok_s']:9.0f} {r['ms_per_step']:8.2f}")
            elif r["event"] != "load":
                print(f"{r.get('backend', ''):8s} {r['event']}: {r.get('error', r.get('batch', ''))}")
    for r in rows:
        if r.get("event") == "env":
            print(f"\n{r}")


if __name__ == "__main__":
    sys.exit(main())
