"""``triton-llm serve``: tritonserver + the OpenAI shim, supervised until Ctrl-C or SIGTERM.

    start server ─► start shim ─► print endpoints ─► watch (exit 1 if either dies or the engine
                                                     loop turns unhealthy: a supervisor restarts us)
    SIGTERM / Ctrl-C ─► drain (unload; open streams finish, up to SERVE_DRAIN_SECONDS) ─► stop ─► 0

Triton's ports bind loopback unless ``--expose-triton``: they have no API keys, so ``--host`` (a
public address) applies to the shim alone, the authenticated front (docs/serving.md, trust model).
"""
from __future__ import annotations

import argparse
import pathlib
import threading
import signal
import subprocess
import sys
import time

from backend.serving.process_group import spawn, terminate_group, wait_port
from backend.serving.server_log import log_tail
from backend.serving.tritonserver import ServerStartError, TritonServer
from common import env

ROOT = pathlib.Path(__file__).resolve().parents[2]
SERVE_DRAIN_SECONDS = env.number("TRITON_LLM_DRAIN_SECONDS")  # open streams may finish this long
EXIT_TIMEOUT = 5                  # tritonserver's own wait on SIGTERM: the drain already waited
HEALTH_INTERVAL = 1.0             # engine death -> unloaded (not ready) within ~2 s


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def start_shim(args: argparse.Namespace, server: TritonServer, workdir: pathlib.Path,
               extra: list[str] | None = None) -> subprocess.Popen | None:
    """Start the OpenAI shim (client/shim) if it exists; None (with a note) otherwise. ``extra``:
    more shim arguments (``--disagg``: the decode server's address)."""
    if not args.shim_port:
        return None
    if not (ROOT / "client" / "shim" / "__main__.py").exists():
        print("[triton-llm] note: client/shim is not present; serving Triton only", file=sys.stderr)
        return None
    cmd = [sys.executable, "-m", "client.shim", "--triton-grpc", server.grpc_url,
           "--host", args.host, "--port", str(args.shim_port), "--model-dir", str(server.model_dir),
           "--chat-db", str(workdir / "chat.sqlite")]      # chats outlive a restart (docs/chat.md)
    if args.api_keys:
        cmd += ["--api-keys", args.api_keys]
    if getattr(args, "insecure_no_api_keys", False):
        cmd += ["--insecure-no-api-keys"]
    for name in getattr(args, "lora_modules", None) or {}:     # model ids the shim maps to adapters
        cmd += ["--lora-name", name]
    cmd += extra or []
    log = workdir / "shim.log"
    proc = spawn(cmd, log, cwd=ROOT)
    if not wait_port(_client_host(args.host), args.shim_port, proc, timeout=60):
        terminate_group(proc, timeout=5)
        raise ServerStartError(f"the OpenAI shim did not start; last lines of {log}:\n{log_tail(log)}")
    return proc


def _print_endpoints(args: argparse.Namespace, server: TritonServer, shim: subprocess.Popen | None,
                     workdir: pathlib.Path) -> None:
    print(f"tritonserver  grpc {server.grpc_url}  http {server.http_url}  metrics {server.metrics_url}")
    print("  models: llm (ensemble, text), engine (token ids), preprocessing, postprocessing")
    if shim is not None:
        host = _client_host(args.host)
        print(f"OpenAI API    http://{host}:{args.shim_port}/v1   (log: {workdir / 'shim.log'})")
        print(f"chat page     http://{host}:{args.shim_port}/")
    print("Ctrl-C to stop.", flush=True)


def watch(servers: TritonServer | list[TritonServer], shim: subprocess.Popen | None, workdir: pathlib.Path) -> int:
    """Return 1 as soon as a server or the shim exits, or an engine loop died; runs until then."""
    servers = [servers] if isinstance(servers, TritonServer) else list(servers)
    next_health = time.monotonic() + HEALTH_INTERVAL
    while True:
        for server in servers:
            if not server.alive():
                print(f"tritonserver exited; last lines of {server.log_path}:\n{log_tail(server.log_path)}",
                      file=sys.stderr)
                return 1
        if shim is not None and shim.poll() is not None:
            print(f"the shim exited; last lines of {workdir / 'shim.log'}:\n{log_tail(workdir / 'shim.log')}",
                  file=sys.stderr)
            return 1
        if time.monotonic() >= next_health:
            next_health = time.monotonic() + HEALTH_INTERVAL
            for server in servers:
                if server.engine_healthy() is False:
                    # A Python model cannot flip its own readiness: unloading it does (readiness of
                    # engine and llm, and so the shim's /ready, go false); exiting lets a supervisor
                    # restart us.
                    print("[triton-llm] the engine loop died (llm_engine_healthy 0); stopping so a "
                          f"supervisor can restart the server. Log: {server.log_path}", file=sys.stderr)
                    server.unload_generation()
                    return 1
        time.sleep(0.5)


def drain(*servers: TritonServer) -> float:
    """Let open requests finish, server by server (a prefill server first: its open prompts hand
    over to the decode server, which drains next); returns how long ``stop()`` may still wait."""
    print(f"\n[triton-llm] draining open requests (up to {SERVE_DRAIN_SECONDS:g}s), then stopping", file=sys.stderr)
    drained = True
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # a second Ctrl-C would orphan the drain
        for server in servers:
            drained = server.drain(SERVE_DRAIN_SECONDS) and drained
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # Drained (the engine cut what was open at the deadline): tritonserver has nothing left and
    # exits at once. Not drained (something stuck): SIGTERM; tritonserver gives up after its exit
    # timeout but may hang in teardown after that, so the group is killed a second later.
    return EXIT_TIMEOUT + (5.0 if drained else 1.0)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def serve_main(args: argparse.Namespace) -> int:
    """``triton-llm serve``: tritonserver + OpenAI shim until Ctrl-C / SIGTERM."""
    workdir = pathlib.Path(args.workdir) if args.workdir else ROOT / "build" / "serve"
    workdir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)
    triton_host = args.host if getattr(args, "expose_triton", False) else "127.0.0.1"
    server = TritonServer(args.model, host=triton_host, http_port=args.http_port, grpc_port=args.grpc_port,
                          metrics_port=args.metrics_port, engine_options=args.engine_option,
                          workdir=workdir, exit_timeout=EXIT_TIMEOUT)
    shim = None
    stop_grace = None                   # stop()'s default unless a drain ran
    try:
        server.start()
        shim = start_shim(args, server, workdir)
        _print_endpoints(args, server, shim, workdir)
        return watch(server, shim, workdir)
    except KeyboardInterrupt:
        stop_grace = drain(server)
        return 0
    except (ServerStartError, ValueError, FileNotFoundError) as exc:
        print(f"[triton-llm] error: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # The shim and tritonserver stop side by side: each waits only for its own children.
        shim_stop = None
        if shim is not None:
            shim_stop = threading.Thread(target=terminate_group, args=(shim,), kwargs={"timeout": 5})
            shim_stop.start()
        server.stop(grace=stop_grace)
        if shim_stop is not None:
            shim_stop.join()
