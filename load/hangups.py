"""Hang-up storm through the OpenAI shim (not part of ``make test``): do clients that hang up make
Triton cancel RPCs, and does Triton still stop cleanly afterwards?

    python -m load.hangups --duration 120 --clients 12

Its own tritonserver (tiny model, ``--log-verbose=1``) and shim. Each client loops: a streamed chat
completion of 2-900 tokens (``ignore_eos``), read for 0-15 SSE lines, then the connection closed
(a stream shorter than that ends on its own first). The shim's request task is cancelled while it
awaits Triton's next response; the shim must answer with the explicit abort and drain the stream,
never with an RPC cancel: Triton 2.51 leaks the state of a stream cancelled as its last write
completes, which keeps ``llm`` loaded until the exit timeout (docs/serving.md). Reports, as JSON:
requests and engine aborts, the RPC cancellations Triton received (its verbose log's
"Cancellation notification received"; must be 0), whether the KV pool is idle after the storm,
and how long the server then takes to stop (``exit_timeout_expired``: a leaked state held ``llm``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import httpx

from load.stack import Stack, resolve_model, stop_timed, wait_engine_idle


async def storm(url: str, seconds: float, clients: int, seed: int) -> dict:
    end = time.monotonic() + seconds
    tally = {"requests": 0, "errors": []}

    async def client(i: int) -> None:
        rng = random.Random(seed + i)
        async with httpx.AsyncClient(timeout=60) as http:
            while time.monotonic() < end:
                body = {"model": "tiny", "stream": True, "ignore_eos": True,
                        "max_tokens": rng.choice([2, 5, 12, 40, 900]),
                        "messages": [{"role": "user", "content": f"hang up {i} {tally['requests']}"}]}
                try:
                    async with http.stream("POST", url + "/chat/completions", json=body) as r:
                        lines, read = rng.randint(0, 15), 0
                        async for _ in r.aiter_lines():
                            read += 1
                            if read >= lines:
                                break
                        await asyncio.sleep(rng.random() * 0.02)
                except httpx.HTTPError as exc:
                    tally["errors"].append(f"{type(exc).__name__}: {exc}"[:200])
                tally["requests"] += 1

    await asyncio.gather(*(client(i) for i in range(clients)))
    return tally


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of hang-ups (default 120)")
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from backend.serving.launcher import terminate_group

    opts = {"num_kv_blocks": "256", "max_num_seqs": "32", "num_threads": "1"}
    with Stack(resolve_model("tiny"), opts, log_verbose=1) as stack:
        tally = asyncio.run(storm(stack.shim_url, args.duration, args.clients, args.seed))
        idle, m = wait_engine_idle(stack.metrics_url)
        terminate_group(stack.shim_proc, timeout=10)    # its drains end before the server stops
        stop_s, held = stop_timed(stack.server)
        log = stack.server.log_path.read_text(errors="replace")
    report = {
        "duration_s": args.duration, "clients": args.clients, "requests": tally["requests"],
        "engine_aborts": m.get("llm_requests_aborted_total", 0.0), "client_errors": tally["errors"][:5],
        "rpc_cancellations_received": log.count("Cancellation notification received"),
        "kv_idle_after": idle, "stop_s": round(stop_s, 1),
        "exit_timeout_expired": held,
    }
    print(json.dumps(report, indent=2))
    ok = idle and not report["rpc_cancellations_received"] and not report["exit_timeout_expired"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
