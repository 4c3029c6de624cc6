"""The serving stack's cost per streamed token, side by side in one run: the in-process engine and
the full stack (OpenAI shim -> llm ensemble over gRPC, or the ensemble over gRPC alone), alternated
round by round so background load hits every contender alike.

    python -m load.overhead_ab --model bench-15m --concurrency 1 16 32 --rounds 2

Before/after a code change in one run: ``NAME@tree=DIR`` serves that contender's stack from another
checkout (e.g. ``git archive <commit> | tar -x -C DIR``, with ``DIR/build`` linked to this tree's
build/ for the cached models and kernels), in a child process with ``DIR`` as its working directory;
the benchmark client stays this tree's. ``NAME@env.VAR=VALUE`` starts that contender's stack with
``VAR=VALUE`` in its environment (e.g. ``http@env.OMP_WAIT_POLICY=PASSIVE``). A tree's stack runs on
``bench.lab_venv``'s overlay of this venv, which serves DIR's code in every process, the stubs included
(a DIR older than ``0e7e138`` still has its own adapters' sys.path lines, which do the same).

Per contender and load point: output tok/s, ITL p50, and the CPU time of every process involved
(the benchmark process, tritonserver and its stubs, the shim) per output token -- CPU time is what
competes with the engine's compute thread on a small machine, and it is robust to being descheduled.
The table shows the best round of each (highest tok/s; lowest CPU ms/token) and the median of the
per-round ratios; the JSON keeps all. ``--keep-up`` starts every contender once and only alternates the
load (short rounds, many pairs: the better choice on a shared, noisy host).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

from backend.serving.process_group import scoped_environ
from bench.lab_venv import lab_venv
from load.backends import EngineBackend, GrpcBackend, ShimBackend
from load.bench import bench_point, warm_up
from load.profile_overhead import cpu_seconds, group_members, label
from load.stack import ROOT, Stack, engine_options, resolve_model
from load.workloads import WorkloadSpec, make_workload

CONTENDERS = {
    "engine": "in-process EngineLoop",
    "http": "full stack: shim + ensemble (engine detokenizes)",
    "grpc": "gRPC ensemble (engine detokenizes)",
}


# run in the other checkout (its own load.stack): start the stack, print its URLs and process
# groups, keep it up until stdin closes
_TREE_STACK = """
import json, sys
from load.stack import Stack, resolve_model
model, opts, shim = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1"
with Stack(resolve_model(model), opts, shim=shim) as st:
    print(json.dumps({"shim_url": st.shim_url if shim else None, "grpc_url": st.grpc_url,
                      "metrics_url": st.metrics_url,
                      "groups": [st.server.proc.pid] + ([st.shim_proc.pid] if st.shim_proc else [])}), flush=True)
    sys.stdin.read()
"""


class TreeStack:
    """The Stack of another checkout, in a child process (same interface as far as this module uses it)."""

    def __init__(self, tree: str, model: str, opts: dict, shim: bool) -> None:
        self.tree, self.model, self.opts, self.shim = tree, model, opts, shim
        self.proc = None

    def __enter__(self) -> "TreeStack":
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        python = lab_venv(self.tree)                   # serves the tree's code, the stubs included
        self.proc = subprocess.Popen([str(python), "-c", _TREE_STACK, str(self.model),
                                      json.dumps({k: str(v) for k, v in self.opts.items()}),
                                      "1" if self.shim else "0"],
                                     cwd=self.tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait()
                raise RuntimeError(f"the stack of {self.tree} did not start (exit {self.proc.returncode})")
            if line.startswith('{"shim_url"'):
                break
        info = json.loads(line)
        self.shim_url, self.grpc_url, self.metrics_url = info["shim_url"], info["grpc_url"], info["metrics_url"]
        self.groups = info["groups"]
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=120)


def _pids(stack) -> list[int]:
    pids = [os.getpid()]
    if isinstance(stack, TreeStack):
        for g in stack.groups:
            pids += group_members(g)
    elif stack is not None:
        pids += group_members(stack.server.proc.pid)
        if stack.shim_proc is not None:
            pids += group_members(stack.shim_proc.pid)
    return pids


def _cpu(pids: list[int]) -> float:
    total = 0.0
    for p in pids:
        try:
            total += cpu_seconds(p)
        except OSError:
            pass
    return total


def _threads(pids: list[int]) -> dict[tuple[int, int], tuple[float, float, int, int]]:
    """Per thread of ``pids``: (ms on a CPU, ms runnable but waiting for one, voluntary and
    involuntary context switches), from /proc/<pid>/task/<tid>/{schedstat,status}."""
    out = {}
    for p in pids:
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tids:
            try:
                run, wait = open(f"/proc/{p}/task/{t}/schedstat").read().split()[:2]
                status = open(f"/proc/{p}/task/{t}/status").read()
                vol = int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
                nvol = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
            except (OSError, IndexError, ValueError):
                continue
            out[(p, int(t))] = (int(run) / 1e6, int(wait) / 1e6, vol, nvol)
    return out


def thread_stats(before: dict, after: dict, tokens: int, top: int = 4) -> list[dict]:
    """The ``top`` threads by CPU over the load point: per output token, ms on a CPU and ms waiting
    on the run queue, and their context switches (``--thread-stats``)."""
    rows = []
    for key, (run, wait, vol, nvol) in after.items():
        r0, w0, v0, n0 = before.get(key, (0.0, 0.0, 0, 0))
        try:
            comm = open(f"/proc/{key[0]}/task/{key[1]}/comm").read().strip()
        except OSError:
            comm = "?"
        rows.append({"pid": key[0], "tid": key[1], "comm": comm, "process": label(key[0]),
                     "run_ms_per_token": (run - r0) / max(tokens, 1), "wait_ms_per_token": (wait - w0) / max(tokens, 1),
                     "voluntary": vol - v0, "involuntary": nvol - n0})
    rows.sort(key=lambda r: -r["run_ms_per_token"])
    return rows[:top]


def process_stats(before: dict, after: dict, tokens: int) -> dict[str, float]:
    """CPU ms per output token of each process (all its threads), by label, busiest first
    (``--thread-stats``): where the stack's CPU above the in-process engine's goes."""
    per: dict[str, float] = {}
    for key, (run, *_rest) in after.items():
        name = label(key[0])
        per[name] = per.get(name, 0.0) + (run - before.get(key, (0.0,))[0]) / max(tokens, 1)
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def split_contender(label: str) -> tuple[str, dict]:
    """``http@stream_interval=0.03`` -> ("http", {"stream_interval": "0.03"}): per-contender options."""
    name, *items = label.split("@")
    if name not in CONTENDERS:
        raise ValueError(f"unknown contender {name!r} (have {', '.join(CONTENDERS)})")
    return name, dict(item.split("=", 1) for item in items)


class Contender:
    """One contender's backend (and stack): ``open`` starts and warms it, ``bench`` runs the load
    points, ``close`` stops it."""

    def __init__(self, label: str, model: str, opts: dict) -> None:
        self.label = label
        self.name, extra = split_contender(label)
        self.tree = extra.pop("tree", None)
        # env.NAME=VALUE: the stack's processes start with it (tritonserver, its stubs, the shim)
        self.env = {k[len("env."):]: extra.pop(k) for k in list(extra) if k.startswith("env.")}
        if self.env and self.name == "engine":
            raise ValueError("env.NAME=VALUE is for stack contenders (the in-process engine is this process)")
        self.model, self.opts = model, {**opts, **extra}
        self.stack = self.be = None

    async def open(self) -> "Contender":
        # read when the stack starts (the repository is generated, the processes spawned)
        with scoped_environ(self.env):
            try:
                name, model, opts, http = self.name, self.model, self.opts, self.name.startswith("http")
                if name == "engine":
                    self.be = EngineBackend(resolve_model(model), opts)
                else:
                    stack = (TreeStack(self.tree, str(resolve_model(model)), opts, shim=http)
                             if self.tree is not None else Stack(resolve_model(model), opts, shim=http))
                    self.stack = stack.__enter__()
                    self.be = (ShimBackend(stack.shim_url, metrics_url=stack.metrics_url) if http
                               else GrpcBackend(stack.grpc_url, metrics_url=stack.metrics_url))
                await self.be.start()
                await warm_up(self.be, 4)
            except BaseException:
                await self.close()
                raise
        return self

    async def close(self) -> None:
        try:
            if self.be is not None:
                await self.be.close()
        finally:
            self.be = None
            if self.stack is not None:
                stack, self.stack = self.stack, None
                stack.__exit__(None, None, None)

    async def bench(self, points: list[tuple[int, int]], seed: int, per_thread: bool = False) -> list[dict]:
        """The load points; ``per_thread``: also the busiest threads' CPU and run-queue wait."""
        out = []
        for conc, n in points:
            jobs = make_workload(WorkloadSpec("mixed", num_jobs=n, input_len=128, output_len=128,
                                              range_ratio=0.5, seed=seed))
            pids = _pids(self.stack)
            th0 = _threads(pids) if per_thread else None
            c0, t0 = _cpu(pids), time.perf_counter()
            point = await bench_point(self.be, jobs, concurrency=conc, request_rate=None, progress=False,
                                      desc=f"{self.name} c={conc}")
            wall, cpu = time.perf_counter() - t0, _cpu(pids) - c0
            th1 = _threads(pids) if per_thread else None
            s = point["summary"]
            tokens = s["total_output_tokens"]
            if s["failed"]:
                print(f"  {self.name} c={conc}: {s['failed']} failed: {s['errors']}", flush=True)
            out.append({"contender": self.label, "concurrency": conc, "requests": n,
                        "tok_s": s["output_throughput"], "itl_p50_ms": s["itl_ms"]["p50"],
                        "tpot_p50_ms": s.get("tpot_ms", {}).get("p50"),
                        "ttft_p50_ms": s["ttft_ms"]["p50"], "wall_s": wall, "cpu_s": cpu,
                        "cpu_ms_per_token": 1000 * cpu / tokens if tokens else None})
            r = out[-1]
            print(f"  {self.label:10s} c={conc:3d}: {r['tok_s']:7.1f} tok/s  ITL p50 {r['itl_p50_ms']:6.2f} ms  "
                  f"CPU {r['cpu_ms_per_token']:.2f} ms/token", flush=True)
            if per_thread and tokens:
                r["processes"] = process_stats(th0, th1, tokens)
                print("    per process, run ms/token: " + ", ".join(
                    f"{k[:28]} {v:.3f}" for k, v in r["processes"].items() if v >= 0.005), flush=True)
                r["threads"] = thread_stats(th0, th1, tokens)
                for t in r["threads"]:
                    print(f"    {t['process'][:28]:28s} {t['comm'][:15]:15s} run {t['run_ms_per_token']:.3f} "
                          f"wait {t['wait_ms_per_token']:.3f} ms/token, switches {t['voluntary']} vol "
                          f"{t['involuntary']} invol", flush=True)
        return out


async def run_contender(label: str, model: str, opts: dict, points: list[tuple[int, int]], seed: int,
                        per_thread: bool = False) -> list[dict]:
    """Start, bench and stop one contender."""
    c = await Contender(label, model, opts).open()
    try:
        return await c.bench(points, seed, per_thread)
    finally:
        await c.close()


def table(results: list[dict], contenders: list[str]) -> str:
    """Best round per contender (highest tok/s, lowest CPU ms/token), and the median over rounds of
    tok/s against the in-process engine's tok/s of the same round (rounds run back to back, so
    this pairs contenders that saw similar background load)."""
    base = next((c for c in contenders if c.split("@")[0] == "engine"), None)
    lines = ["| streams | contender | tok/s (best) | of in-process (best / median per round) | "
             "ITL p50 ms | CPU ms / token (best) |", "|---|---|---|---|---|---|"]
    concs = sorted({r["concurrency"] for r in results})
    for c in concs:
        best, per_round = {}, {}
        for name in contenders:
            rows = [r for r in results if r["contender"] == name and r["concurrency"] == c]
            if rows:
                top = max(rows, key=lambda r: r["tok_s"])
                best[name] = (top["tok_s"], top["itl_p50_ms"], min(r["cpu_ms_per_token"] for r in rows))
                per_round[name] = {r["round"]: r["tok_s"] for r in rows if "round" in r}
        for name, (tok, itl, cpu) in best.items():
            share = "-"
            if base in best:
                paired = [t / per_round[base][rnd] for rnd, t in per_round[name].items() if rnd in per_round[base]]
                med = f" / {statistics.median(paired):.0%}" if paired else ""
                share = f"{tok / best[base][0]:.0%}{med}"
            lines.append(f"| {c} | {name} | {tok:.0f} | {share} | {itl:.2f} | {cpu:.2f} |")
    return "\n".join(lines)


async def main_async(args) -> dict:
    opts = engine_options(args.model, args.engine_option)
    n_for = {c: max(args.min_requests, c * args.requests_per_stream) for c in args.concurrency}
    points = [(c, n_for[c]) for c in args.concurrency]
    results = []
    up: dict[str, Contender] = {}
    try:
        if args.keep_up:                    # every stack up (idle) at once; rounds only run the load
            for name in args.contenders:
                print(f"starting {name}", flush=True)
                up[name] = await Contender(name, args.model, opts).open()
        for rnd in range(args.rounds):
            order = args.contenders if rnd % 2 == 0 else list(reversed(args.contenders))
            for name in order:
                print(f"round {rnd + 1}: {name}", flush=True)
                try:
                    rows = await (up[name].bench(points, args.seed, args.thread_stats) if args.keep_up
                                  else run_contender(name, args.model, opts, points, args.seed, args.thread_stats))
                except Exception as exc:    # noqa: BLE001 - a stack that did not start (a busy host): next
                    print(f"  {name}: round {rnd + 1} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    continue
                for r in rows:
                    r["round"] = rnd + 1
                    results.append(r)
    finally:
        for c in up.values():
            await c.close()
    return {"command": "python -m load.overhead_ab " + " ".join(sys.argv[1:]), "model": args.model,
            "engine_options": opts, "results": results, "table": table(results, args.contenders)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m load.overhead_ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench-15m")
    p.add_argument("--contenders", nargs="+", default=["engine", "http"],
                   help=f"of {', '.join(CONTENDERS)}; NAME@KEY=VALUE adds an engine option")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--keep-up", action="store_true",
                   help="start every contender once and keep them up (idle) between rounds: short rounds, "
                        "many pairs (memory for all stacks at once)")
    p.add_argument("--out", default=None)
    p.add_argument("--thread-stats", action="store_true",
                   help="per load point, the busiest threads' CPU and run-queue wait per token (/proc schedstat)")
    args = p.parse_args(argv)
    res = asyncio.run(main_async(args))
    out = pathlib.Path(args.out or ROOT / "load" / "results" / f"overhead-ab-{pathlib.Path(args.model).name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(res["command"])
    print(res["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
