"""Where the serving stack spends its CPU: one benchmark load point against the full stack, with
the CPU time of every process (tritonserver, each Python-backend stub, the shim, this client) and a
py-spy profile of the Python ones (self time by function).

    pip install py-spy                     # or: pip install --target /tmp/pyspy py-spy
    python -m load.profile_overhead --model bench-15m --via grpc --concurrency 32
    python -m load.profile_overhead --model bench-15m --via engine     # in-process, for contrast

Writes load/results/profile-<model>-<via>.md (and the raw py-spy stacks beside it).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

from load.backends import EngineBackend, GrpcBackend, ShimBackend
from load.bench import bench_point, warm_up
from load.stack import ROOT, Stack, engine_options, resolve_model
from load.workloads import WorkloadSpec, make_workload

RESULTS = ROOT / "load" / "results"
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (its threads included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def label(pid: int) -> str:
    try:
        cmd = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"pid {pid}"
    text = " ".join(c.decode(errors="replace") for c in cmd if c)
    if "triton_python_backend_stub" in text:
        model = text.split("model_repository/")[1].split("/")[0] if "model_repository/" in text else "?"
        return f"stub: {model}"
    if "tritonserver" in text:
        return "tritonserver"
    if "client.shim" in text:
        return "shim (uvicorn)"
    return text[:60]


def group_members(pgid: int) -> list[int]:
    out = []
    for d in pathlib.Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getpgid(int(d.name)) == pgid:
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def summarize_raw(path: pathlib.Path, top: int = 12) -> list[tuple[str, float]]:
    """py-spy raw (collapsed) stacks -> the functions with the most self time, as fractions
    (lines of one function merged; a sample with no Python frame is native code, e.g. a stub's
    IPC loop)."""
    own: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        leaf = stack.split(";")[-1].strip()
        func, _, where = leaf.partition(" (")
        name = f"{func} ({where.split(':')[0]})" if where else "(no Python frame: native code)"
        own[name] += int(count)
        total += int(count)
    return [(name, n / total) for name, n in own.most_common(top)] if total else []


async def run(args) -> str:
    spec = WorkloadSpec("mixed", num_jobs=args.num_requests, input_len=128, output_len=128, range_ratio=0.5)
    opts = engine_options(args.model, args.engine_option)
    pyspy = args.py_spy or shutil.which("py-spy")
    stem = RESULTS / f"profile-{pathlib.Path(args.model).name}-{args.via}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    stack = None
    if args.via == "engine":
        be = EngineBackend(resolve_model(args.model), opts)
    else:
        stack = Stack(resolve_model(args.model), opts, shim=args.via == "http").__enter__()
        be = (ShimBackend(stack.shim_url, metrics_url=stack.metrics_url) if args.via == "http"
              else GrpcBackend(stack.grpc_url, metrics_url=stack.metrics_url))
    try:
        await be.start()
        await warm_up(be, 4)
        pids = [os.getpid()]
        if stack is not None:
            pids += group_members(stack.server.proc.pid)
            if stack.shim_proc is not None:
                pids += group_members(stack.shim_proc.pid)
        names = {p: ("benchmark client" if p == os.getpid() else label(p)) for p in pids}
        python_pids = [p for p in pids if names[p].startswith(("stub", "shim")) or p == os.getpid()]
        spies = {}
        if pyspy:
            for p in python_pids:
                out = pathlib.Path(f"{stem}-{names[p].replace(' ', '_').replace(':', '')}-{p}.txt")
                spies[p] = (out, subprocess.Popen(
                    [pyspy, "record", "--pid", str(p), "--rate", "200", "--format", "raw", "--nonblocking",
                     "--output", str(out), "--duration", "600"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            await asyncio.sleep(1.0)              # let py-spy attach
        before = {p: cpu_seconds(p) for p in pids}
        t0 = time.perf_counter()
        point = await bench_point(be, make_workload(spec), concurrency=args.concurrency, request_rate=None,
                                  desc=f"{args.model} {args.via}")
        wall = time.perf_counter() - t0
        after = {p: cpu_seconds(p) for p in pids}
        for _, proc in spies.values():
            proc.send_signal(signal.SIGINT)       # py-spy writes its output on SIGINT
        for _, proc in spies.values():
            proc.wait(timeout=60)
    finally:
        await be.close()
        if stack is not None:
            stack.__exit__(None, None, None)

    s = point["summary"]
    lines = [f"`python -m load.profile_overhead {' '.join(sys.argv[1:])}`", "",
             f"{args.model} via {args.via}, {args.concurrency} streams: {s['output_throughput']:.0f} output tok/s, "
             f"TTFT p50 {s['ttft_ms']['p50']:.0f} ms, ITL p50 {s['itl_ms']['p50']:.1f} ms, wall {wall:.1f} s, "
             f"{os.cpu_count()} CPUs", "", "| process | CPU s | share of the machine |", "|---|---|---|"]
    total = 0.0
    for p in sorted(pids, key=lambda p: before[p] - after[p]):
        used = after[p] - before[p]
        total += used
        if used >= 0.05:
            lines.append(f"| {names[p]} | {used:.1f} | {used / (wall * os.cpu_count()):.0%} |")
    lines.append(f"| **all** | {total:.1f} | {total / (wall * os.cpu_count()):.0%} |")
    for p, (out, _) in spies.items():
        if out.exists():
            lines += ["", f"py-spy, {names[p]} (self time, all threads):", ""]
            lines += [f"- {frac:5.1%}  {name}" for name, frac in summarize_raw(out)]
    text = "\n".join(lines) + "\n"
    stem.with_suffix(".md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m load.profile_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench-15m")
    p.add_argument("--via", choices=["grpc", "http", "engine"], default="grpc")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=96)
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--py-spy", default=None, help="py-spy binary (default: on PATH; none = CPU times only)")
    args = p.parse_args(argv)
    print(asyncio.run(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
