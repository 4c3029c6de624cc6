"""Soak benchmark (issue 19; not part of ``make test``): mixed traffic for a while, then checks.

    python -m load.soak --duration 600            # starts its own tritonserver (tiny model)
    python -m load.soak --duration 180 --model models/default

16 concurrent streams through the ``llm`` ensemble (TritonLLMClient, as the shim uses it): 12 of
them are the tenant ``flood``, 4 the tenant ``calm``; 30 % of requests are cancelled mid-way (the
consumer stops reading: the client's explicit abort), 10 % are bad (``max_tokens=0``). The kind
``hangup`` (``--mix``) cancels the consuming task while it awaits the next response instead, as
the shim's task is cancelled when its HTTP client hangs up. Every 5 s the RSS of every process of
the server's process group (tritonserver, each Python stub) is recorded. At the end it reports
the RSS slope per process over the second half (MiB/min), whether the KV pool is back to idle,
failed valid requests (must be 0), how long the server then takes to stop (a request state Triton
leaked holds ``llm`` until the 10 s exit timeout: ``exit_timeout_expired``) and the fair-share ratio: tokens/s per calm stream over tokens/s
per flood stream (1.0 = equal share per stream; the engine caps a tenant at
``max_running_per_tenant``). Results as JSON on stdout.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import threading
import time

from client.errors import AbortedError, InvalidRequestError
from client.triton_client import TritonLLMClient
from load.stack import stop_timed, wait_engine_idle


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def group_pids(pgid: int) -> dict[int, str]:
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.getpgid(int(d)) == pgid:
                    with open(f"/proc/{d}/cmdline", "rb") as f:
                        cmd = f.read().split(b"\0")
                    name = os.path.basename(cmd[0].decode())
                    model = next((c.decode() for c in cmd if c.endswith(b"model.py")), "")
                    out[int(d)] = f"{name}:{model.split('/')[-3]}" if model else name
            except (OSError, IndexError):
                pass
    return out


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope in MiB per minute."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    den = sum((t - mt) ** 2 for t, _ in points) or 1.0
    return 60.0 * sum((t - mt) * (v - mv) for t, v in points) / den


async def worker(client, tenant: str, stop_at: float, tally: dict, rng: random.Random,
                 mix: dict[str, float]) -> None:
    while time.monotonic() < stop_at:
        kind = rng.choices(list(mix), weights=list(mix.values()))[0]
        params = {"max_tokens": 0 if kind == "bad" else rng.randint(16, 64), "temperature": 0.7,
                  "tenant": tenant, "ignore_eos": True}
        # a hang-up anywhere up to the last token: near the end it meets Triton's last write
        cut = rng.randint(1, params["max_tokens"]) if kind == "hangup" else rng.randint(2, 8)
        t0, tokens = time.monotonic(), 0
        reached = asyncio.Event()

        async def consume() -> None:
            nonlocal tokens
            async for chunk in client.generate(prompt=f"soak {rng.random()}", params=params):
                tokens += len(chunk.token_ids)
                if kind == "cancel" and tokens >= cut:
                    break
                if kind == "hangup" and tokens >= cut:
                    reached.set()                # and read on: the hang-up finds us awaiting a read
        try:
            if kind == "hangup":
                task, hang_up = asyncio.ensure_future(consume()), asyncio.ensure_future(reached.wait())
                await asyncio.wait([task, hang_up], return_when=asyncio.FIRST_COMPLETED)
                task.cancel()                    # a no-op on a stream that ended first
                hang_up.cancel()
                (result,) = await asyncio.gather(task, return_exceptions=True)
                if isinstance(result, Exception):   # CancelledError is not one: the hang-up itself
                    raise result
            else:
                await consume()
            tally[tenant]["tokens"] += tokens
            tally[tenant]["busy_s"] += time.monotonic() - t0
            tally["done"][kind] += 1
            if kind == "bad":
                tally["failed"].append("a bad request was accepted")
        except InvalidRequestError:
            tally["done"][kind] += 1
            if kind != "bad":
                tally["failed"].append("a valid request was refused")
        except AbortedError:
            tally["done"][kind] += 1
        except Exception as exc:                 # noqa: BLE001 -- counted, reported
            tally["failed"].append(f"{kind}: {type(exc).__name__}: {exc}"[:200])


async def traffic(url: str, duration: float, streams: int, seed: int, mix: dict[str, float]) -> dict:
    tally = {t: {"tokens": 0, "busy_s": 0.0, "streams": 0} for t in ("flood", "calm")}
    tally.update(done=dict.fromkeys(("ok", "cancel", "hangup", "bad"), 0), failed=[])
    stop_at = time.monotonic() + duration
    async with TritonLLMClient(url) as client:
        tasks = []
        for i in range(streams):
            tenant = "calm" if i % 4 == 0 else "flood"
            tally[tenant]["streams"] += 1
            tasks.append(worker(client, tenant, stop_at, tally, random.Random(seed + i), mix))
        await asyncio.gather(*tasks)
        await client.wait_aborts()
    return tally


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default 600)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--model", default=None, help="checkpoint (default: the tiny test model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mix", default="ok=60,cancel=30,bad=10", help="request kinds and weights")
    args = ap.parse_args(argv)
    mix = {k: float(v) for k, v in (item.split("=") for item in args.mix.split(","))}

    from backend.serving.launcher import TritonServer
    from tests.conftest import model_dir
    model = args.model or model_dir("tiny")
    opts = {"num_kv_blocks": "512", "max_num_seqs": "16", "num_threads": "1", "max_running_per_tenant": "8"}
    with TritonServer(model, engine_options=opts, quiet=True) as server:
        samples: dict[int, list[tuple[float, float]]] = {}
        names: dict[int, str] = {}
        done = threading.Event()
        t_start = time.monotonic()

        def sample() -> None:
            while not done.wait(5.0):
                for pid, name in group_pids(server.proc.pid).items():
                    v = rss_mib(pid)
                    if v is not None:
                        names[pid] = name
                        samples.setdefault(pid, []).append((time.monotonic() - t_start, v))
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        tally = asyncio.run(traffic(server.grpc_url, args.duration, args.streams, args.seed, mix))
        idle, _ = wait_engine_idle(server.metrics_url)
        done.set()
        sampler.join()
        stop_s, held = stop_timed(server)
    rate = {t: tally[t]["tokens"] / max(1e-9, tally[t]["busy_s"]) for t in ("flood", "calm")}
    half = args.duration / 2
    report = {
        "duration_s": args.duration, "streams": args.streams, "requests": tally["done"],
        "failed_valid_requests": len(tally["failed"]), "failures": tally["failed"][:10],
        "kv_idle_at_end": idle,
        "stop_s": round(stop_s, 1), "exit_timeout_expired": held,
        "tokens": {t: tally[t]["tokens"] for t in ("flood", "calm")},
        "fair_share_calm_over_flood_per_stream": round(rate["calm"] / max(1e-9, rate["flood"]), 3),
        "rss": {f"{names[p]}[{p}]": {"start_mib": round(s[0][1], 1), "end_mib": round(s[-1][1], 1),
                                     "slope_mib_per_min_2nd_half": round(slope([x for x in s if x[0] >= half]), 3)}
                for p, s in samples.items() if s},
    }
    print(json.dumps(report, indent=2))
    return 0 if not tally["failed"] and idle and not held else 1


if __name__ == "__main__":
    raise SystemExit(main())
