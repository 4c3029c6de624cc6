"""``triton-llm serve --disagg``: two tritonservers, one engine in role=prefill and one in role=decode
(each in its own process group, optionally pinned to its own cores), and the OpenAI shim routing
between them with client/disagg_client.py (docs/disaggregation.md).

    prefill server  --http/--grpc/--metrics-port           (the shim's --triton-grpc)
    decode server   the same ports + 10                     (the shim's --triton-grpc-decode)
    KV              engine option kv_connector=shm (default, one host) or tcp; the pair shares a
                    fresh secret (a 0600 file in a 0700 temporary directory, kv_secret_file) unless
                    one is given, so the TCP connector is authenticated (docs/disaggregation.md)

``DisaggServers`` is the reusable part (tests and backend/disagg/bench_stack.py start the pair with
it); ``pin_tree`` / ``sched_tree`` set the CPU affinity / scheduling policy and nice value of a
process and every thread of it and of its children (tritonserver, its Python stubs and their torch
threads); ``apply_layout`` places the pair on two CPU sets (default ``isolate``: the decode engine
alone on its CPUs, docs/disaggregation.md "CPU layout").
"""
from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import signal
import sys
import tempfile
import threading

from backend.serving.tritonserver import ServerStartError, TritonServer


def add_arguments(sv: argparse.ArgumentParser) -> None:
    sv.add_argument("--disagg", action="store_true",
                    help="prefill/decode disaggregation: one prefill and one decode tritonserver behind the shim")
    sv.add_argument("--disagg-cpus", default="auto", metavar="PREFILL:DECODE",
                    help="with --disagg: CPUs of each role, e.g. 0:1 or 0-1:2-3; 'auto' (default): this "
                         "process's CPUs split in two halves; 'none': not pinned")
    sv.add_argument("--disagg-layout", default="isolate", choices=LAYOUTS,
                    help="with --disagg-cpus: isolate (default): the decode engine alone on the decode CPUs, "
                         "front ends + shim + prefill engine (nice 19) on the prefill CPUs; split: the same "
                         "but the decode front end and shim free; stubs: only the engines pinned; tree: each "
                         "server's whole process tree pinned (docs/disaggregation.md)")


def parse_cpus(spec: str | None) -> tuple[set[int], set[int]] | None:
    """"0:1" / "0-1:2,3" -> ({0}, {1}) / ({0, 1}, {2, 3}); "auto": this process's CPUs halved
    (None with fewer than 2); None / "" / "none" -> None."""
    if not spec or spec == "none":
        return None
    if spec == "auto":
        mine = sorted(os.sched_getaffinity(0))
        if len(mine) < 2:
            return None
        half = len(mine) // 2
        return set(mine[:half]), set(mine[half:])

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


def tree_pids(roots: list[int]):
    """Each live process of ``roots`` and of their descendants, once."""
    todo, seen = list(roots), set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        yield p
        try:
            todo += _children(p)
        except OSError:                 # gone meanwhile
            pass


def tree_tids(pid: int, *, include_root: bool = True, descendants: bool = True) -> list[int]:
    """Every thread id of ``pid`` (``include_root``) and of its descendants (``descendants``)."""
    if include_root:
        procs = tree_pids([pid]) if descendants else [pid]
    else:
        procs = tree_pids(_children(pid)) if descendants else []
    out: list[int] = []
    for p in procs:
        try:
            out += [int(t) for t in os.listdir(f"/proc/{p}/task")]
        except OSError:
            continue
    return out


def pin_tree(pid: int, cpus: set[int], *, include_root: bool = True, descendants: bool = True) -> int:
    """Pin every thread of ``pid`` and of its descendants to ``cpus``; returns threads pinned.
    ``include_root=False`` pins only the descendants (tritonserver's Python stubs, where the engine
    runs), leaving tritonserver's own front-end threads free to run on any core;
    ``descendants=False`` only the root's own threads. Threads created later inherit it."""
    n = 0
    for tid in tree_tids(pid, include_root=include_root, descendants=descendants):
        try:
            os.sched_setaffinity(tid, cpus)
            n += 1
        except OSError:
            pass
    return n


def sched_tree(pid: int, *, nice: int = 0, policy: int = os.SCHED_OTHER, include_root: bool = True,
               descendants: bool = True) -> int:
    """Set the scheduling policy (SCHED_OTHER / SCHED_BATCH / SCHED_IDLE) and nice value of every
    thread of the tree (Linux: both are per thread and inherited by new threads). Best effort: a
    negative nice needs CAP_SYS_NICE and is skipped without it. Returns threads changed."""
    n = 0
    for tid in tree_tids(pid, include_root=include_root, descendants=descendants):
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except OSError:
            pass
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
            n += 1
        except OSError:
            pass
    return n


def pin_named(pid: int, names: tuple[str, ...], cpus: set[int]) -> int:
    """Pin the threads of ``pid``'s descendants whose OS name (comm) is one of ``names``."""
    n = 0
    for tid in tree_tids(pid, include_root=False):
        try:
            with open(f"/proc/{tid}/comm") as f:
                if f.read().strip() not in names:
                    continue
            os.sched_setaffinity(tid, cpus)
            n += 1
        except OSError:
            pass
    return n


# decode-stub threads that do no token-path work and whose work is GIL-free (memcpy, page faults,
# munmap): on the prefill CPUs under isolate / idle / split, so that they never take the decode
# engine's core (backend/disagg/placer.py KVPlacer: a hand-over's fetch + KV write)
OFF_DECODE_THREADS = ("kv-admit",)

LAYOUTS = ("isolate", "idle", "split", "stubs", "tree")
PREFILL_NICE = 19            # isolate / split: the prefill engine yields its core at once
TOKEN_PATH_NICE = -10        # isolate / split: the decode server, the prefill front end and ``others``


def apply_layout(pair: "DisaggServers", layout: str, cpus: tuple[set[int], set[int]],
                 others: tuple[int, ...] = ()) -> None:
    """Place the pair's processes on ``cpus`` = (prefill cpus, decode cpus); re-appliable (every
    thread is first reset to both cpu sets, SCHED_OTHER, nice 0).

    isolate (default) the decode engine (the decode server's Python stubs) ALONE on the decode
            cpus; everything else -- both tritonserver front ends, the prefill engine and
            ``others`` (the shim, a bench client) -- on the prefill cpus, the prefill engine at
            SCHED_BATCH / nice 19 so that the front ends, which carry every token to the client,
            preempt it at once. The token path (decode server, prefill front end, ``others``) at
            nice -10 where allowed (CAP_SYS_NICE), against other jobs on the host. Measured: the
            lowest ITL p99 and p99/p50 (2.0-2.7 x), at ~1.4 x the median of ``stubs``. The decode
            stub's hand-over copy thread (``OFF_DECODE_THREADS``) goes to the prefill cpus too
            (isolate, idle, split).
    idle    isolate with the prefill engine at SCHED_IDLE (any waking thread preempts it; it
            runs only on otherwise idle time of its cpus, so other jobs on the host starve it)
    split   isolate, but the decode front end and ``others`` free on all cpus (a response from
            the decode engine is a synchronous hand-off to the front end, so it may run at once on
            whichever core is free); measured: median between isolate and stubs, p99 erratic
    stubs   each server's stubs (engine) on its cpus, tritonserver's front ends and ``others`` free
    tree    each server's whole process tree on its cpus (front end included)
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)} (got {layout!r})")
    pre, dec = cpus
    both = pre | dec
    roots = [s.proc.pid for s in pair.servers] + list(others)
    for pid in roots:
        pin_tree(pid, both)
        sched_tree(pid)
    if layout == "stubs":
        pin_tree(pair.prefill.proc.pid, pre, include_root=False)
        pin_tree(pair.decode.proc.pid, dec, include_root=False)
    elif layout == "tree":
        pin_tree(pair.prefill.proc.pid, pre)
        pin_tree(pair.decode.proc.pid, dec)
    else:
        pin_tree(pair.prefill.proc.pid, pre)
        if layout in ("isolate", "idle"):
            pin_tree(pair.decode.proc.pid, pre, descendants=False)   # decode front end
            for pid in others:
                pin_tree(pid, pre)
        pin_tree(pair.decode.proc.pid, dec, include_root=False)       # decode engine
        pin_named(pair.decode.proc.pid, OFF_DECODE_THREADS, pre)      # its hand-over KV copies
        sched_tree(pair.decode.proc.pid, nice=TOKEN_PATH_NICE)
        for pid in [pair.prefill.proc.pid, *others]:
            sched_tree(pid, nice=TOKEN_PATH_NICE, descendants=pid != pair.prefill.proc.pid)
        sched_tree(pair.prefill.proc.pid, nice=PREFILL_NICE, include_root=False,
                   policy=os.SCHED_IDLE if layout == "idle" else os.SCHED_BATCH)


class DisaggServers:
    """A prefill and a decode TritonServer for one checkpoint, started side by side.

    ``engine_options`` apply to both (the role is added); ``cpus`` = (prefill cpus, decode cpus)
    places the processes once both are ready by ``layout`` (``apply_layout``: ``isolate``, the
    default, puts the decode engine alone on its cpus and everything else, the prefill engine at
    low priority, on the prefill cpus; the others measured worse: docs/disaggregation.md).
    ``others`` (pids, e.g. the shim) are placed with the front ends."""

    def __init__(self, model_dir, *, engine_options: dict | list | None = None,
                 cpus: tuple[set[int], set[int]] | None = None, workdir: str | os.PathLike | None = None,
                 ports: tuple[dict, dict] | None = None, layout: str = "isolate", **server_kw) -> None:
        from backend.serving.repository import parse_engine_options

        opts = parse_engine_options(engine_options)
        self._own_secret = not opts.get("kv_secret_file")     # start() makes one for the pair
        self._secret_dir: str | None = None
        base = pathlib.Path(workdir) if workdir else None
        p_ports, d_ports = ports or ({}, {})
        self.prefill = TritonServer(model_dir, engine_options={**opts, "role": "prefill"},
                                    workdir=base / "prefill" if base else None, **p_ports, **server_kw)
        self.decode = TritonServer(model_dir, engine_options={**opts, "role": "decode"},
                                   workdir=base / "decode" if base else None, **d_ports, **server_kw)
        self.cpus = cpus
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)} (got {layout!r})")
        self.layout = layout

    @property
    def servers(self) -> tuple[TritonServer, TritonServer]:
        return self.prefill, self.decode

    def start(self) -> "DisaggServers":
        """Start both at once. The children die with the *thread* that spawned them
        (PR_SET_PDEATHSIG, process_group.py), so each starter thread lives until ``stop()``."""
        errors: list[BaseException] = []
        self._held = threading.Event()
        if self._own_secret and self._secret_dir is None:     # one secret per pair, by file (never argv)
            from backend.disagg.secret import write_secret
            self._secret_dir = tempfile.mkdtemp(prefix="tllm-kv-")     # mode 0700
            path = write_secret(os.path.join(self._secret_dir, "kv.secret"))
            for s in self.servers:
                s.engine_options["kv_secret_file"] = path
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
        self.place()
        return self

    def place(self, layout: str | None = None, others: tuple[int, ...] = ()) -> None:
        """(Re)apply the cpu layout (no-op without ``cpus``); ``others``: more pids to place."""
        if self.cpus is not None:
            apply_layout(self, layout or self.layout, self.cpus, others)

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
        if self._secret_dir is not None:
            shutil.rmtree(self._secret_dir, ignore_errors=True)
            self._secret_dir = None

    def __enter__(self) -> "DisaggServers":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_disagg(args: argparse.Namespace) -> int:
    """``triton-llm serve --disagg``: the pair + the shim until Ctrl-C / SIGTERM."""
    from backend.serving.process_group import terminate_group
    from backend.serving.serve import EXIT_TIMEOUT, ROOT, _interrupt, drain, start_shim, watch

    workdir = pathlib.Path(args.workdir) if args.workdir else ROOT / "build" / "serve-disagg"
    workdir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)
    host = args.host if getattr(args, "expose_triton", False) else "127.0.0.1"
    ports = ({"http_port": args.http_port, "grpc_port": args.grpc_port, "metrics_port": args.metrics_port},
             {"http_port": args.http_port + 10, "grpc_port": args.grpc_port + 10,
              "metrics_port": args.metrics_port + 10})
    shim, stop_grace = None, None
    try:
        pair = DisaggServers(args.model, engine_options=args.engine_option, cpus=parse_cpus(args.disagg_cpus),
                             layout=getattr(args, "disagg_layout", "isolate"), workdir=workdir, ports=ports,
                             host=host, exit_timeout=EXIT_TIMEOUT)
    except ValueError as exc:
        print(f"[triton-llm] error: {exc}", file=sys.stderr)
        return 1
    try:
        pair.start()
        shim = start_shim(args, pair.prefill, workdir, extra=["--triton-grpc-decode", pair.decode.grpc_url])
        if shim is not None:
            pair.place(others=(shim.pid,))          # the shim joins the front ends
        for name, s in (("prefill", pair.prefill), ("decode", pair.decode)):
            print(f"{name:8} tritonserver  grpc {s.grpc_url}  http {s.http_url}  metrics {s.metrics_url}")
        if shim is not None:
            print(f"OpenAI API    http://{'127.0.0.1' if args.host in ('0.0.0.0', '') else args.host}:"
                  f"{args.shim_port}/v1   (log: {workdir / 'shim.log'})")
        print("Ctrl-C to stop.", flush=True)
        return watch(pair.servers, shim, workdir)
    except KeyboardInterrupt:
        stop_grace = drain(pair.prefill, pair.decode)   # new requests refused; open prefills hand over
        return 0
    except (ServerStartError, ValueError, FileNotFoundError) as exc:
        print(f"[triton-llm] error: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if shim is not None:
            terminate_group(shim, timeout=5)
        pair.stop(grace=stop_grace)
