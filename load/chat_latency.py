"""``/v1/models`` latency while another tenant fills the chat store to its quota (issue 30; not part
of ``make test``):

    python -m load.chat_latency [--user-chars 10000] [--assistant-chars 100000] [--max-bytes 33554432]

Its own tritonserver (the default model, SmolLM2: a 10k-character turn needs its 8k context) and shim
(two API keys, two tenants). Tenant ``builder`` makes
one conversation and adds turns the way the chat page does (a user message, whose context the
server computes, then the assistant's reply) until the byte quota refuses one (429
``insufficient_quota``), then reads the whole conversation back 5 times. Meanwhile tenant
``prober`` asks ``GET /v1/models`` every 20 ms from its own process (so the builder's reading of
a 30 MB answer never delays the prober's clock), after one warm-up call. Reports, as JSON: the idle baseline and the
latencies during the build and the read-back (median, p99, max in ms, and the three slowest probes
with their time into the phase), the turns stored and the conversation's size.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from load.stack import Stack
from backend.serving.process_group import wait_http_ok

BUILDER, PROBER = "sk-bench-builder", "sk-bench-prober"


def _summary(ms: list[float]) -> dict:
    s = sorted(ms)
    return {"n": len(s), "median_ms": round(statistics.median(s), 2),
            "p99_ms": round(s[min(len(s) - 1, int(len(s) * 0.99))], 2), "max_ms": round(s[-1], 2)}


def _probe_process(url: str, stop, out) -> None:
    """In its own process: (monotonic time, latency ms) of each ``GET /v1/models`` until ``stop``."""
    samples = []
    with httpx.Client(headers={"Authorization": f"Bearer {PROBER}"}, timeout=30) as http:
        http.get(url + "/v1/models").raise_for_status()            # warm-up: the card's first ask
        out.put("ready")
        while not stop.is_set():
            t0 = time.perf_counter()
            r = http.get(url + "/v1/models")
            samples.append((time.monotonic(), (time.perf_counter() - t0) * 1000, r.status_code))
            time.sleep(0.02)
    out.put(samples)


async def _build(url: str, user_chars: int, assistant_chars: int, max_turns: int) -> tuple[int, str]:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {BUILDER}"}, timeout=300) as http:
        conv = (await http.post(url + "/api/conversations", json={})).json()["id"]
        turns = 0
        while turns < max_turns:
            r = await http.post(f"{url}/api/conversations/{conv}/messages",
                                json={"content": f"turn {turns} " + "question text " * (user_chars // 14)})
            if r.status_code == 429:
                return turns, conv
            r.raise_for_status()
            parent = r.json()["message"]["id"]
            r = await http.post(f"{url}/api/conversations/{conv}/messages",
                                json={"role": "assistant", "parent_id": parent,
                                      "content": "answer words " * (assistant_chars // 13)})
            if r.status_code == 429:
                return turns, conv
            r.raise_for_status()
            turns += 1
        return turns, conv


async def _read_back(url: str, conv: str, times: int) -> int:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {BUILDER}"}, timeout=300) as http:
        size = 0
        for _ in range(times):
            r = await http.get(f"{url}/api/conversations/{conv}")
            r.raise_for_status()
            size = len(r.content)
        return size


async def _run(url: str, args) -> dict:
    ctx = multiprocessing.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    prober = ctx.Process(target=_probe_process, args=(url, stop, out))
    prober.start()
    assert out.get(timeout=120) == "ready"
    marks = [("idle", time.monotonic())]
    await asyncio.sleep(3)
    report: dict = {}
    marks.append(("build", time.monotonic()))
    turns, conv = await _build(url, args.user_chars, args.assistant_chars, args.max_turns)
    report["turns_stored"] = turns
    marks.append(("read_back", time.monotonic()))
    report["conversation_json_bytes"] = await _read_back(url, conv, 5)
    marks.append(("end", time.monotonic()))
    stop.set()
    samples = out.get(timeout=120)
    prober.join(30)
    for (phase, t0), (_, t1) in zip(marks, marks[1:]):
        ms = [v for t, v, _ in samples if t0 <= t < t1]
        errors = sum(1 for t, _, code in samples if t0 <= t < t1 and code != 200)
        # where in the phase its slowest probes were (s from its start): a stall at 0 s is the
        # phase's first request, one spread over the phase is steady work (or the host's other jobs)
        slowest = sorted(((v, t - t0) for t, v, _ in samples if t0 <= t < t1), reverse=True)[:3]
        report[phase] = {**_summary(ms), "errors": errors, "seconds": round(t1 - t0, 1),
                         "slowest": [f"{v:.1f} ms at {at:.1f} s" for v, at in slowest]}
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--user-chars", type=int, default=10_000)
    ap.add_argument("--assistant-chars", type=int, default=100_000)
    ap.add_argument("--max-bytes", type=int, default=None, help="the tenant byte quota (default: the shim's)")
    ap.add_argument("--max-turns", type=int, default=10**9, help="stop there if the quota has not")
    ap.add_argument("--shim-pythonpath", default=None,
                    help="PYTHONPATH for the shim process (a side-by-side run of another checkout's client/)")
    args = ap.parse_args(argv)

    from backend.serving.launcher import free_port, terminate_group

    from backend.default_model import ensure_default_model

    with Stack(ensure_default_model(), {"num_kv_blocks": "600", "num_threads": "1"}, shim=False) as stack, \
            tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.txt"
        keys.write_text(f"{BUILDER}:builder\n{PROBER}:prober\n")
        port = free_port()
        cmd = [sys.executable, "-m", "client.shim", "--triton-grpc", stack.grpc_url, "--host", "127.0.0.1",
               "--port", str(port), "--api-keys", str(keys), "--model-dir", str(stack.server.model_dir),
               "--model-name", "tiny", "--chat-db", str(Path(tmp) / "chat.sqlite"), "--log-level", "warning"]
        if args.max_bytes:
            cmd += ["--chat-max-bytes", str(args.max_bytes)]
        env = dict(os.environ, PYTHONPATH=args.shim_pythonpath) if args.shim_pythonpath else None
        cwd = args.shim_pythonpath.split(os.pathsep)[0] if args.shim_pythonpath else None   # -m puts cwd first
        shim = subprocess.Popen(cmd, start_new_session=True, env=env, cwd=cwd)
        url = f"http://127.0.0.1:{port}"
        try:
            if not wait_http_ok(url + "/health", shim, 180):
                raise RuntimeError("the shim did not start")
            report = asyncio.run(_run(url, args))
        finally:
            terminate_group(shim, timeout=10)
    report["command"] = "python -m load.chat_latency " + " ".join(argv if argv is not None else sys.argv[1:])
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
