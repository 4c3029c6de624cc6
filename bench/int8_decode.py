"""int8 against fp32 decode speed in one process, and the share of the host's read bandwidth that a
1-stream decode reaches (issue 28's speed goals: int8 >= fp32 at 16 streams, >= 75 % of the read
bandwidth at 1 stream).

    python -m bench.int8_decode [--methods none int8 int8@0] [--streams 1 16] [--tokens 64] [--rounds 3]

Every variant is loaded at once; each round times every variant in turn at each stream count
(offline ``LLM.generate``, greedy, ``ignore_eos``, 8-word prompts), best round per variant. Method
specs as load.bench_quant's (``int8``: the default groups of 32; ``int8@0``: per output channel;
``+head``: the LM head quantized too). Bytes per decode token: every decoder projection and the LM
head as held (quantized: int8 + fp16 scales; the embedding lookup reads one row and is not counted).
Bandwidth: load/bandwidth.py's probes (a tensor sum and the fused step's fp32 GEMV, best of both) on
the engine's thread count; ``bw_share`` = 1-stream tok/s x bytes per token / that bandwidth. The
1-stream rate includes each request's prefill (8-word prompts, a few ms of 64 tokens' time).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch

from load.bandwidth import gemv_gbps, read_gbps
from load.bench_quant import ROOT, markdown, parse_spec, prompts


def decode_bytes(model) -> int:
    """Bytes one decode token reads: the decoder layers' parameters and the LM head as held."""
    layers = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    head = getattr(model, "lm_head_q", None)
    head_bytes = head.quant_weight().nbytes() if head is not None else \
        model.lm_head_weight().numel() * model.lm_head_weight().element_size()
    return layers + head_bytes


def main(argv: list[str] | None = None) -> int:
    from backend import LLM, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "default"))
    ap.add_argument("--methods", nargs="+", default=["none", "int8", "int8@0"])
    ap.add_argument("--streams", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="engine num_threads (default: the engine's)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    texts = prompts(max(a.streams))
    params = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    llms, rows = {}, {}
    for spec in a.methods:
        opts = parse_spec(spec) | ({"num_threads": a.threads} if a.threads else {})
        llms[spec] = LLM(a.model, **opts)
        llms[spec].generate(texts[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        model = llms[spec].engine.runner.model
        rows[spec] = {"method": spec, "MB_per_token": decode_bytes(model) / 1e6}
    for _ in range(a.rounds):
        for n in a.streams:
            for spec, llm in llms.items():
                t0 = time.perf_counter()
                llm.generate(texts[:n], params)
                rate = n * a.tokens / (time.perf_counter() - t0)
                rows[spec][f"tok_s_{n}"] = max(rate, rows[spec].get(f"tok_s_{n}", 0.0))
    threads = a.threads or torch.get_num_threads()
    bw = max(read_gbps(threads), gemv_gbps(threads) or 0.0)
    base = rows[a.methods[0]]
    for r in rows.values():
        for n in a.streams:
            r[f"x_{n}"] = r[f"tok_s_{n}"] / base[f"tok_s_{n}"]
        if 1 in a.streams:
            r["GB_s_1"] = r["tok_s_1"] * r["MB_per_token"] / 1e3
            r["bw_share_1"] = r["GB_s_1"] / bw
    out = list(rows.values())
    print(markdown(out))
    print(f"host read bandwidth, {threads} thread(s): {bw:.1f} GB/s")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps({"bandwidth_gbs": bw, "rows": out}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
