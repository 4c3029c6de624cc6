"""``triton-llm serve --disagg``: two tritonservers, one engine in role=prefill and one in role=decode
(each in its own process group, optionally pinned to its own cores), and the OpenAI shim routing
between them with client/disagg_client.py (docs/disaggregation.md).

    prefill server  --http/--grpc/--metrics-port           (the shim's --triton-grpc)
    decode server   the same ports + 10                     (the shim's --triton-grpc-decode)
    KV              engine option kv_connector=shm (default, one host) or tcp; the pair shares a
                    fresh secret (a 0600 file in a 0700 temporary directory, kv_secret_file) unless
                    one is given, so the TCP connector is authenticated (docs/disaggregation.md)

``DisaggServers`` is the reusable part (tests and bench/disagg_stack.py start the pair with
it); where its threads run is backend/serving/disagg_layout.py (``apply_layout``: the decode
engine alone on its CPUs, docs/disaggregation.md "CPU layout").
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

from backend.serving.disagg_layout import apply_layout, parse_cpus
from backend.serving.tritonserver import ServerStartError, TritonServer


def add_arguments(sv: argparse.ArgumentParser) -> None:
    sv.add_argument("--disagg", action="store_true",
                    help="prefill/decode disaggregation: one prefill and one decode tritonserver behind the shim")
    sv.add_argument("--disagg-cpus", default="auto", metavar="PREFILL:DECODE",
                    help="with --disagg: CPUs of each role, e.g. 0:1 or 0-1:2-3; 'auto' (default): this "
                         "process's CPUs split in two halves; 'none': not pinned. The decode engine runs "
                         "alone on the decode CPUs; the front ends, the shim and the prefill engine (nice 19) "
                         "on the prefill CPUs (docs/disaggregation.md)")


class DisaggServers:
    """A prefill and a decode TritonServer for one checkpoint, started side by side.

    ``engine_options`` apply to both (the role is added); ``cpus`` = (prefill cpus, decode cpus)
    places the processes once both are ready (``apply_layout``: the decode engine alone on its
    cpus and everything else, the prefill engine at low priority, on the prefill cpus).
    ``others`` (pids, e.g. the shim) are placed with the front ends."""

    def __init__(self, model_dir, *, engine_options: dict | list | None = None,
                 cpus: tuple[set[int], set[int]] | None = None, workdir: str | os.PathLike | None = None,
                 ports: tuple[dict, dict] | None = None, **server_kw) -> None:
        from backend.serving.repository import parse_engine_options

        opts = parse_engine_options(engine_options)
        self._secret_dir: str | None = None
        if not opts.get("kv_secret_file"):              # one secret per pair, by file (never argv);
            from backend.disagg.secret import write_secret   # removed by stop()
            self._secret_dir = tempfile.mkdtemp(prefix="tllm-kv-")     # mode 0700
            opts["kv_secret_file"] = write_secret(os.path.join(self._secret_dir, "kv.secret"))
        base = pathlib.Path(workdir) if workdir else None
        p_ports, d_ports = ports or ({}, {})
        try:
            self.prefill = TritonServer(model_dir, engine_options={**opts, "role": "prefill"},
                                        workdir=base / "prefill" if base else None, **p_ports, **server_kw)
            self.decode = TritonServer(model_dir, engine_options={**opts, "role": "decode"},
                                       workdir=base / "decode" if base else None, **d_ports, **server_kw)
        except BaseException:
            self._drop_secret()
            raise
        self.cpus = cpus

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
        self.place()
        return self

    def place(self, others: tuple[int, ...] = ()) -> None:
        """(Re)apply the cpu layout (no-op without ``cpus``); ``others``: more pids to place."""
        if self.cpus is not None:
            apply_layout(self, self.cpus, others)

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
        self._drop_secret()

    def _drop_secret(self) -> None:
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
                             workdir=workdir, ports=ports,
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
