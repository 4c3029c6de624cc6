"""Disaggregated vs unified serving, side by side in one run, through real tritonservers (issue 21).

    .venv/bin/python -m bench.disagg_stack --preset bench-15m --seconds 24 --rounds 2 \
        --burst-len 512 --burst-every 6 --layouts unified,disagg

Layouts, same two cores (``--layouts``, comma-separated, each run every round in that order):
  unified  one tritonserver, engine role=unified, torch num_threads=2, the process tree on cores A,B
  disagg   serve --disagg's pair: a prefill and a decode tritonserver, num_threads=1 each, KV over
           shm, routed by client/disagg_client.py; the decode engine (the decode server's Python
           stubs) ALONE on core B; both front ends, the prefill engine and this bench client on
           core A, the prefill engine at SCHED_BATCH nice 19, the token path at nice -10 (when
           root) (backend/serving/disagg_layout.py apply_layout)
A pair is re-placed before each of its rounds. (The rejected placements idle / split / stubs / tree
reproduce at commit ``42f3c1c``.)
Workload (the engine model over gRPC, token ids in/out, greedy): ``--streams`` steady decode streams
of ``--stream-tokens`` tokens each (restarted as they finish, so that many are always decoding),
plus every ``--burst-every`` s a burst of ``--burst`` prompts of ``--burst-len`` tokens (distinct:
no prefix hits) generating ``--burst-tokens`` each. Reported, after ``--warmup`` s: the steady
streams' inter-token latency p50/p99 (per token: the gap between two responses / tokens in the
later one), the bursts' TTFT p50/p99, generated tokens/s, and the CPU seconds each layout's
processes used. Layouts alternate per round (A/B/A/B), all servers started up front; each layout
gets its own random prompts (the layouts share one pair: repeated prompts would be prefix hits).

This client's heap is frozen after start-up (``--client-gc``): its own full collections (up to
240 ms) would otherwise be counted as ITL. (The decode-step trace and the ``layout+knob`` A/Bs of
issue 21's runs reproduce at commit ``9d8fea3``.)

Engine options per layout: ``layout~key=value[~key=value]`` runs that layout on
its own server(s) started with those engine options on top of the bench's, e.g.
``--layouts disagg,disagg~kv_cache_dtype=fp16,unified,unified~kv_cache_dtype=fp16`` (``~env.NAME=VALUE``:
that environment variable for the layout's servers, e.g. ``unified~env.TRITON_LLM_HUGE_PAGES=0``; one more
pair / unified server per distinct option set, all started up front).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time

from backend.serving.disagg_layout import parse_cpus, pin_tree, sched_tree, tree_pids
from backend.serving.disagg_serve import DisaggServers
from backend.serving.process_group import scoped_environ
from backend.serving.tritonserver import TritonServer
from client.disagg_client import DisaggLLMClient
from client.triton_client import TritonLLMClient


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def run_phase(client, a, seed: int, tag: str = "") -> dict:
    # distinct prompts per layout: the disaggregated layouts share one pair, whose prefix cache
    # would otherwise serve a later layout the bursts an earlier one prefilled (TTFT ~4 x lower)
    rng = random.Random(f"{seed}-{tag}")
    itl: list[float] = []
    ttft: list[float] = []
    tokens = 0
    t_start = time.monotonic()
    t_measure = t_start + a.warmup
    t_end = t_measure + a.seconds

    async def stream(k: int) -> None:
        nonlocal tokens
        n = 0
        while time.monotonic() < t_end:
            prompt = [rng.randrange(5, 3000) for _ in range(a.stream_prompt)]
            m = a.stream_tokens
            if a.stagger and n == 0:               # stream k's first request is (k+1)/streams as long
                m = max(1, (k + 1) * a.stream_tokens // a.streams)
            params = {"max_tokens": m, "min_tokens": m, "temperature": 0, "ignore_eos": True}
            last = None
            ch_rid = f"s{seed}{tag}-{k}-{n}"
            agen = client.generate_ids(prompt, request_id=ch_rid, params=params)
            try:
                async for ch in agen:
                    now = time.monotonic()
                    m = len(ch.token_ids)
                    if m and now >= t_measure and now < t_end:
                        tokens += m
                        if last is not None:
                            itl.extend([(now - last) / m] * m)
                    if m:
                        last = now
                    if now >= t_end:
                        break
            finally:
                await agen.aclose()
            n += 1

    async def burst_one(i: int, j: int) -> None:
        nonlocal tokens
        prompt = [rng.randrange(5, 3000) for _ in range(a.burst_len)]
        t0 = time.monotonic()
        first = None
        params = {"max_tokens": a.burst_tokens, "min_tokens": a.burst_tokens, "temperature": 0}
        async for ch in client.generate_ids(prompt, request_id=f"b{seed}{tag}-{i}-{j}", params=params):
            now = time.monotonic()
            if ch.token_ids and first is None:
                first = now - t0
                if t_measure <= t0 < t_end:
                    ttft.append(first)
            if t_measure <= now < t_end:
                tokens += len(ch.token_ids)

    async def bursts() -> None:
        i, tasks = 0, []
        await asyncio.sleep(a.burst_every / 2)
        while time.monotonic() < t_end - 1:
            tasks += [asyncio.create_task(burst_one(i, j)) for j in range(a.burst)]
            i += 1
            await asyncio.sleep(a.burst_every)
        await asyncio.gather(*tasks)

    await asyncio.gather(bursts(), *(stream(k) for k in range(a.streams)))
    await client.close()
    return {"itl_p50": pct(itl, 0.5), "itl_p99": pct(itl, 0.99), "ttft_p50": pct(ttft, 0.5),
            "ttft_p99": pct(ttft, 0.99), "tok_s": tokens / a.seconds, "n_itl": len(itl), "n_ttft": len(ttft)}


async def warm_up(client) -> None:
    try:
        async for _ in client.generate_ids(list(range(5, 69)), params={"max_tokens": 4, "temperature": 0}):
            pass
    finally:
        await client.close()


def tree_cpu(pids: list[int]) -> float:
    """CPU seconds (user + sys) of the processes and their descendants so far."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for p in tree_pids(pids):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError, IndexError):
            pass
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="bench-15m")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-prompt", type=int, default=32)
    ap.add_argument("--stream-tokens", type=int, default=256)
    ap.add_argument("--stagger", action="store_true",
                    help="stagger the steady streams: stream k's first request generates (k+1)/streams of "
                         "--stream-tokens, so their restarts (and context lengths) spread out instead of all "
                         "streams growing from the prompt to prompt+tokens together (a decode step's cost "
                         "grows with the batch's total context: 1.45 x over a synchronized cycle here)")
    ap.add_argument("--burst", type=int, default=4)
    ap.add_argument("--burst-len", type=int, default=768)
    ap.add_argument("--burst-tokens", type=int, default=16)
    ap.add_argument("--burst-every", type=float, default=4.0)
    ap.add_argument("--cpus", default="0:1", help="PREFILL:DECODE cores; unified gets both")
    ap.add_argument("--connector", default="shm", choices=["shm", "tcp"])
    ap.add_argument("--client-gc", default="freeze", choices=["freeze", "default"],
                    help="freeze (default): gc.freeze() this client's heap (torch, tritonclient...) once the "
                         "servers are up, so that its own full collections (100-250 ms measured) do not "
                         "show as ITL; default: Python's GC untouched")
    ap.add_argument("--layouts", default="unified,disagg",
                    help="comma-separated, from unified,disagg, each optionally ~key=value[~key=value]")
    a = ap.parse_args()
    layouts = a.layouts.split(",")
    for lay in layouts:
        lay = lay.split("~")[0]
        if lay not in ("unified", "disagg"):
            ap.error(f"unknown layout {lay!r}")
    from tests.conftest import model_dir

    cpus = parse_cpus(a.cpus)
    path = model_dir(a.preset)
    opts = {"num_kv_blocks": "1024", "block_size": "16", "max_num_seqs": "32", "max_num_batched_tokens": "512",
            "kv_connector": a.connector}
    def eng_opts(layout: str) -> tuple[str, tuple]:
        """'disagg~k=v~k2=v2' -> ('disagg', (('k', 'v'), ('k2', 'v2')))"""
        head = layout.split("~")
        return head[0], tuple(sorted(tuple(x.split("=", 1)) for x in head[1:]))

    unifieds: dict[tuple, TritonServer] = {}
    pairs: dict[tuple, DisaggServers] = {}
    envs: dict[int, dict] = {}                       # id(server) -> its env.NAME=VALUE options

    def engine_only(extra: tuple) -> dict:
        return {k: v for k, v in extra if not k.startswith("env.")}

    for layout in layouts:
        base, extra = eng_opts(layout)
        if base == "unified" and extra not in unifieds:
            unifieds[extra] = TritonServer(path, engine_options={**opts, "num_threads": "2", **engine_only(extra)},
                                           quiet=True)
        elif base != "unified" and extra not in pairs:
            pairs[extra] = DisaggServers(path, engine_options={**opts, "num_threads": "1", **engine_only(extra)},
                                         cpus=cpus, quiet=True)
        server = unifieds[extra] if base == "unified" else pairs[extra]
        envs[id(server)] = {k[len("env."):]: v for k, v in extra if k.startswith("env.")}

    def start(server) -> None:
        """Start ``server`` with its env.NAME=VALUE options in its (tritonserver's, stubs') environment."""
        with scoped_environ(envs[id(server)]):
            server.start()

    try:
        for unified in unifieds.values():
            start(unified)
            pin_tree(unified.proc.pid, cpus[0] | cpus[1])
            asyncio.run(warm_up(TritonLLMClient(unified.grpc_url)))
        for pair in pairs.values():
            start(pair)
            # one request through each before measuring: first-call costs, and the decode engine names
            # its threads at its first step (bench thread CPU by name)
            asyncio.run(warm_up(DisaggLLMClient(pair.prefill.grpc_url, pair.decode.grpc_url)))
        results: dict[str, list[dict]] = {lay: [] for lay in layouts}
        if a.client_gc == "freeze":
            import gc
            gc.collect()
            gc.freeze()
        me = os.getpid()
        for r in range(a.rounds):
            for layout in layouts:
                base_layout, extra = eng_opts(layout)
                if base_layout == "unified":
                    unified = unifieds[extra]
                    pin_tree(me, cpus[0] | cpus[1])
                    sched_tree(me)
                    client = TritonLLMClient(unified.grpc_url)
                    procs = [unified.proc.pid]
                else:
                    pair = pairs[extra]
                    pair.place(others=(me,))
                    client = DisaggLLMClient(pair.prefill.grpc_url, pair.decode.grpc_url)
                    procs = [s.proc.pid for s in pair.servers]
                cpu0, me0 = tree_cpu(procs), os.times()
                res = asyncio.run(run_phase(client, a, seed=r, tag=layout))
                res["cpu_s"] = tree_cpu(procs) - cpu0
                me1 = os.times()
                res["client_cpu_s"] = me1.user + me1.system - me0.user - me0.system
                results[layout].append(res)
                print(f"round {r} {layout:8} " + " ".join(f"{k}={v:.4g}" for k, v in res.items()), flush=True)
    finally:
        for server in [*unifieds.values(), *pairs.values()]:
            server.stop()
    print(f"\npreset={a.preset} streams={a.streams}x{a.stream_tokens} tok{' staggered' if a.stagger else ''}, "
          f"bursts {a.burst}x{a.burst_len}-token "
          f"prompts every {a.burst_every}s ({a.burst_tokens} tok each), {a.seconds}s x {a.rounds} rounds, "
          f"cpus={a.cpus}, connector={a.connector}, host cores={os.cpu_count()}, "
          f"loadavg={os.getloadavg()[0]:.1f}")
    print("| layout | ITL p50 ms | ITL p99 ms | p99/p50 (rounds) | burst TTFT p50 ms | TTFT p99 ms | tokens/s | CPU s |")
    print("|---|---|---|---|---|---|---|---|")
    for layout, rs in results.items():
        med = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
        rr = " / ".join(f"{x['itl_p99'] / x['itl_p50']:.1f}" for x in rs)
        print(f"| {layout} | {1e3 * med['itl_p50']:.1f} | {1e3 * med['itl_p99']:.1f} | "
              f"{med['itl_p99'] / med['itl_p50']:.2f} ("
              f"{rr}) | {1e3 * med['ttft_p50']:.0f} | {1e3 * med['ttft_p99']:.0f} | "
              f"{med['tok_s']:.0f} | {med['cpu_s']:.0f} |")


if __name__ == "__main__":
    main()
