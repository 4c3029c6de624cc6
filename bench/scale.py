"""Prefix-hit rate of multi-turn chat through the Ray Serve app: the prefix-aware router against
Ray's default power-of-two-choices router, in one run (docs/scale_out.md has the numbers).

    python -m bench.scale --model build/models/tiny --conversations 12 --turns 4

Each router gets a fresh application (cold caches) on the same local Ray instance; the workload is
``conversations`` chats of ``turns`` user turns, interleaved round-robin, greedy. A follow-up (turn
>= 2) is a *hit* when its usage reports the previous turn's whole prompt as cached (all but the
last partial block): a cached first block alone does not count, since the chat template's opening
tokens are common to every conversation. Also checks that greedy output is identical whichever
replica (and router) served it.
"""
from __future__ import annotations

import argparse
import json
import time
import urllib.request
from collections import Counter

SYSTEM = "You are a helpful assistant. Conversation {c} is about topic number {c}; keep answers short."


def _post(base: str, body: dict) -> dict:
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def workload(base: str, conversations: int, turns: int, max_tokens: int) -> tuple[list[dict], list[str]]:
    convs = {c: [{"role": "system", "content": SYSTEM.format(c=c)}] for c in range(conversations)}
    rows, texts = [], []
    for turn in range(turns):
        for c, msgs in convs.items():
            prev_prompt = rows[-conversations]["prompt_tokens"] if turn else 0
            msgs.append({"role": "user", "content": f"Question {turn} in conversation {c}: go on."})
            out = _post(base, {"model": "bench", "messages": msgs, "max_tokens": max_tokens, "temperature": 0})
            text = out["choices"][0]["message"]["content"]
            msgs.append({"role": "assistant", "content": text})
            cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
            rows.append({"id": out["id"], "conv": c, "turn": turn, "prompt_tokens": out["usage"]["prompt_tokens"],
                         "cached": cached, "hit": bool(turn and cached >= prev_prompt - 16)})
            texts.append(text)
    return rows, texts


def main(argv: list[str] | None = None) -> int:
    import ray
    from ray import serve

    from triton_llm.scale.app import ScaleConfig, build_app
    from backend.serving.process_group import free_port

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--engine-option", action="append", default=["num_kv_blocks=256", "block_size=16",
                   "max_num_seqs=32", "max_num_batched_tokens=512", "num_threads=1"])
    a = p.parse_args(argv)
    opts = dict(o.split("=", 1) for o in a.engine_option)
    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    results = {}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for name, prefix in (("prefix", True), ("power_of_two", False)):
            cfg = ScaleConfig(model_dir=a.model, engine_options=opts, replicas=a.replicas, replica_cpus=0.5,
                              ingress_cpus=0.25, prefix_routing=prefix, shim={"model_name": "bench"})
            t0 = time.monotonic()
            serve.run(build_app(cfg), name=f"bench-{name}", route_prefix="/")
            rows, texts = workload(f"http://127.0.0.1:{port}", a.conversations, a.turns, a.max_tokens)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/scale/stats", timeout=30) as r:
                served = json.loads(r.read())["served"]
            per_replica = sorted(Counter(served.get(r["id"], "?") for r in rows).values(), reverse=True)
            follow = [r for r in rows if r["turn"]]
            results[name] = {"follow_ups": len(follow), "hits": sum(r["hit"] for r in follow),
                             "hit_rate": sum(r["hit"] for r in follow) / max(1, len(follow)),
                             "cached_tokens": sum(r["cached"] for r in follow),
                             "seconds": round(time.monotonic() - t0, 1), "texts": texts,
                             "per_replica": per_replica}
            serve.delete(f"bench-{name}")
    finally:
        serve.shutdown()
        ray.shutdown()
    same = results["prefix"]["texts"] == results["power_of_two"]["texts"]
    for name, r in results.items():
        print(f"{name:13s} follow-up prefix hits {r['hits']}/{r['follow_ups']} = {r['hit_rate']:.0%}  "
              f"cached tokens {r['cached_tokens']}  requests per replica {r['per_replica']}  "
              f"({r['seconds']} s incl. start)")
    print(f"greedy output identical under both routers (any replica): {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
