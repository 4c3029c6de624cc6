"""``triton-llm serve --disagg``: two tritonservers, one engine in role=prefill and one in role=decode
(each in its own process group, optionally pinned to its own cores), and the OpenAI shim routing
between them with client/disagg_client.py (docs/disaggregation.md).

    prefill server  --http/--grpc/--metrics-port           (the shim's --triton-grpc)
    decode server   the same ports + 10                     (the shim's --triton-grpc-decode)
    KV              engine option kv_connector=shm (default, one host) or tcp

``DisaggServers`` is the reusable part (tests and backend/disagg/bench_stack.py start the pair with
it); ``pin_tree`` sets the CPU affinity of a process and every thread of it and of its children
(tritonserver, its Python stubs and their torch threads).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import signal
import sys
import threading
import time

from backend.serving.tritonserver import ServerStartError, TritonServer


def add_arguments(sv: argparse.ArgumentParser) -> None:
    sv.add_argument("--disagg", action="store_true",
                    help="prefill/decode disaggregation: one prefill and one decode tritonserver behind the shim")
    sv.add_argument("--disagg-cpus", default=None, metavar="PREFILL:DECODE",
                    help="with --disagg: pin each server's engine (its Python stubs) to CPUs, e.g. 0:1 or "
                         "0-1:2-3; tritonserver's front-end threads stay free (default: not pinned)")


def parse_cpus(spec: str | None) -> tuple[set[int], set[int]] | None:
    """"0:1" / "0-1:2,3" -> ({0}, {1}) / ({0, 1}, {2, 3})."""
    if not spec:
        return None

    def one(part: str) -> set[int]:
        out: set[int] = set()
        for item in part.split(","):
            a, _, b = item.partition("-")
            out.update(range(int(a), int(b or a) + 1))
        return out

    try:
        pre, dec = spec.split(":")
        return one(pre), one(dec)
    except ValueError:
        raise ValueError(f"--disagg-cpus must look like PREFILL:DECODE, e.g. 0:1 (got {spec!r})") from None


def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def pin_tree(pid: int, cpus: set[int], *, include_root: bool = True) -> int:
    """Pin every thread of ``pid`` and of its descendants to ``cpus``; returns threads pinned.
    ``include_root=False`` pins only the descendants (tritonserver's Python stubs, where the engine
    runs), leaving tritonserver's own front-end threads free to run on any core."""
    n, todo, seen = 0, ([pid] if include_root else _children(pid)), set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(int(tid), cpus)
                n += 1
            except OSError:
                pass
        todo += _children(p)
    return n


class DisaggServers:
    """A prefill and a decode TritonServer for one checkpoint, started side by side.

    ``engine_options`` apply to both (the role is added); ``cpus`` = (prefill cpus, decode cpus)
    pins each server's Python stubs (the engine and its threads) once it is ready (new threads
    inherit it); ``pin_root=True`` pins tritonserver's own front-end threads too, which measured
    3-5 x worse decode ITL p50 on 2 cores (each response then waits for the busy engine's core:
    docs/benchmarks.md)."""

    def __init__(self, model_dir, *, engine_options: dict | list | None = None,
                 cpus: tuple[set[int], set[int]] | None = None, workdir: str | os.PathLike | None = None,
                 ports: tuple[dict, dict] | None = None, pin_root: bool = False, **server_kw) -> None:
        from backend.serving.repository import parse_engine_options

        opts = parse_engine_options(engine_options)
        base = pathlib.Path(workdir) if workdir else None
        p_ports, d_ports = ports or ({}, {})
        self.prefill = TritonServer(model_dir, engine_options={**opts, "role": "prefill"},
                                    workdir=base / "prefill" if base else None, **p_ports, **server_kw)
        self.decode = TritonServer(model_dir, engine_options={**opts, "role": "decode"},
                                   workdir=base / "decode" if base else None, **d_ports, **server_kw)
        self.cpus = cpus
        self.pin_root = pin_root

    @property
    def servers(self) -> tuple[TritonServer, TritonServer]:
        return self.prefill, self.decode

    def start(self) -> "DisaggServers":
        """Start both at once. The children die with the *thread* that spawned them
        (PR_SET_PDEATHSIG, process_group.py), so each starter thread lives until ``stop()``."""
        errors: list[BaseException] = []
        self._held = threading.Event()
        ready = [threading.Event() for _ in self.servers]

        def start(server: TritonServer, done: threading.Event) -> None:
            try:
                try:
                    server.start()
                except ServerStartError as exc:
                    # tritonserver 2.51 sometimes aborts while loading a Python stub on a heavily
                    # loaded host (boost::interprocess::lock_exception); one more try
                    if "lock_exception" not in str(exc):
                        raise
                    server.start()
            except BaseException as exc:        # noqa: BLE001 - reported below
                errors.append(exc)
            finally:
                done.set()
            self._held.wait()

        for s, done in zip(self.servers, ready):
            threading.Thread(target=start, args=(s, done), name="disagg-server", daemon=True).start()
        for done in ready:
            done.wait()
        if errors:
            self.stop()
            raise errors[0]
        if self.cpus is not None:
            for server, cpus in zip(self.servers, self.cpus):
                pin_tree(server.proc.pid, cpus, include_root=self.pin_root)
        return self

    def alive(self) -> bool:
        return all(s.alive() for s in self.servers)

    def stop(self, grace: float | None = None) -> None:
        threads = [threading.Thread(target=s.stop, kwargs={} if grace is None else {"grace": grace})
                   for s in self.servers if s.proc is not None]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        held = getattr(self, "_held", None)
        if held is not None:
            held.set()

    def __enter__(self) -> "DisaggServers":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_disagg(args: argparse.Namespace) -> int:
    """``triton-llm serve --disagg``: the pair + the shim until Ctrl-C / SIGTERM."""
    from backend.serving.process_group import terminate_group
    from backend.serving.serve import EXIT_TIMEOUT, ROOT, SERVE_DRAIN_SECONDS, _interrupt, start_shim
    from backend.serving.server_log import log_tail

    workdir = pathlib.Path(args.workdir) if args.workdir else ROOT / "build" / "serve-disagg"
    workdir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)
    host = args.host if getattr(args, "expose_triton", False) else "127.0.0.1"
    ports = ({"http_port": args.http_port, "grpc_port": args.grpc_port, "metrics_port": args.metrics_port},
             {"http_port": args.http_port + 10, "grpc_port": args.grpc_port + 10,
              "metrics_port": args.metrics_port + 10})
    shim = None
    try:
        pair = DisaggServers(args.model, engine_options=args.engine_option, cpus=parse_cpus(args.disagg_cpus),
                             workdir=workdir, ports=ports, host=host, exit_timeout=EXIT_TIMEOUT)
    except ValueError as exc:
        print(f"[triton-llm] error: {exc}", file=sys.stderr)
        return 1
    try:
        pair.start()
        shim = start_shim(args, pair.prefill, workdir, extra=["--triton-grpc-decode", pair.decode.grpc_url])
        for name, s in (("prefill", pair.prefill), ("decode", pair.decode)):
            print(f"{name:8} tritonserver  grpc {s.grpc_url}  http {s.http_url}  metrics {s.metrics_url}")
        if shim is not None:
            print(f"OpenAI API    http://{'127.0.0.1' if args.host in ('0.0.0.0', '') else args.host}:"
                  f"{args.shim_port}/v1   (log: {workdir / 'shim.log'})")
        print("Ctrl-C to stop.", flush=True)
        while True:
            for s in pair.servers:
                if not s.alive():
                    print(f"tritonserver exited; last lines of {s.log_path}:\n{log_tail(s.log_path)}",
                          file=sys.stderr)
                    return 1
            if shim is not None and shim.poll() is not None:
                print(f"the shim exited; last lines of {workdir / 'shim.log'}:\n"
                      f"{log_tail(workdir / 'shim.log')}", file=sys.stderr)
                return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        print(f"\n[triton-llm] draining (up to {SERVE_DRAIN_SECONDS:g}s), then stopping", file=sys.stderr)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        pair.prefill.drain(SERVE_DRAIN_SECONDS)     # new requests refused; open prefills hand over
        pair.decode.drain(SERVE_DRAIN_SECONDS)
        return 0
    except (ServerStartError, ValueError, FileNotFoundError) as exc:
        print(f"[triton-llm] error: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if shim is not None:
            terminate_group(shim, timeout=5)
        pair.stop()
