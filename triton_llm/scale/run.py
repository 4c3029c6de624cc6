"""``triton-llm serve --replicas N``: the Ray Serve application on this machine (or, with
``RAY_ADDRESS`` set, on an existing Ray cluster), the shim on ``--host``/``--shim-port``.

The local cluster has token auth and loopback-only ports; a joined one must have token auth
(triton_llm/scale/ray_cluster.py). Blocks until Ctrl-C / SIGTERM, which stops the stack in any phase:
before the application is running, Ray is torn down at once (its workers end, and with them the
replicas' tritonservers); once it runs, Serve shuts down first (each replica drains, up to its
graceful shutdown, and stops its tritonserver); a second signal skips what is left of that. Ray
is imported only here, so plain ``serve`` never needs it.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from triton_llm.scale.ray_cluster import (ClusterRefused, check_join, lock_down_local, reap_local, remove_token,
                                       size_cpus)
from backend.serving.repository import parse_engine_options
from common import env

APP_NAME = "triton-llm"


class _Stopped(BaseException):
    """Raised in the main thread by SIGINT / SIGTERM, wherever it is waiting."""


def shim_fields(args: argparse.Namespace) -> dict:
    """The ingress shim's ShimSettings fields: its keys, and the host the Serve proxy binds (an
    open shim refuses one beyond loopback)."""
    shim = {"host": args.host, "insecure_no_api_keys": bool(getattr(args, "insecure_no_api_keys", False))}
    if args.api_keys:
        shim["api_keys_file"] = args.api_keys
    return shim


def config_from_args(args: argparse.Namespace):
    from triton_llm.scale.app import ScaleConfig

    shim = shim_fields(args)
    autoscale = args.max_replicas is not None
    return ScaleConfig(
        model_dir=str(args.model), engine_options=parse_engine_options(args.engine_option),
        replicas=args.replicas, autoscale=autoscale, min_replicas=args.min_replicas or 1,
        max_replicas=args.max_replicas or args.replicas, prefix_routing=not args.default_router,
        target_ongoing_requests=args.target_ongoing, upscale_delay_s=args.upscale_delay,
        downscale_delay_s=args.downscale_delay, fallback_model_dir=args.fallback_model,
        fallback_tenants=list(args.fallback_tenant or []), fallback_max_ongoing=args.fallback_max_ongoing,
        fallback_queue_s=args.fallback_queue_s, fallback_model_name=args.fallback_name,
        prefill_replicas=args.prefill_replicas or 0, shim=shim)


def _raise_stopped(*_) -> None:
    raise _Stopped()


def _on_signals(handler) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def serve_replicas(args: argparse.Namespace) -> int:
    rc = _serve(args)
    if "ray" in sys.modules:
        # Everything is stopped; Ray's client threads would hold the interpreter ~7 s more at exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


def _serve(args: argparse.Namespace) -> int:
    _on_signals(_raise_stopped)                         # before Ray starts: every phase stops
    address = env.raw("RAY_ADDRESS")
    token_dir = None
    running = False
    try:
        _check_keys(args)
        if address:
            check_join(address, args.ray_address_insecure)
        else:
            token_dir = lock_down_local()
        import ray
        from ray import serve

        from triton_llm.scale.app import build_app

        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        # A cluster of our own runs its workers at our priority: Ray's default puts them 15 nice levels
        # below the driver, where the replicas' tritonservers starve beside their own -19 engine
        # threads (Triton then finds a stub unhealthy) or beside any background job.
        ray.init(address=address or None, include_dashboard=False,
                 runtime_env={"env_vars": {"PYTHONPATH": root}},
                 **({} if address else {"_system_config": {"worker_niceness": 0}}))
        _on_signals(_raise_stopped)                     # ray.init installs its own (it exits at once)
        cfg = size_cpus(config_from_args(args), float(ray.cluster_resources().get("CPU", 0)),
                        args.replica_cpus, args.ingress_cpus, enforce=not address)
        serve.start(http_options={"host": args.host, "port": args.shim_port})
        try:
            serve.run(build_app(cfg), name=APP_NAME, route_prefix="/", blocking=False)
        except RuntimeError as exc:                     # a deployment failed (Ray has the traceback)
            print(f"serve --replicas: {str(exc).splitlines()[0]}", file=sys.stderr)
            return 1
        running = True
        count = f"{cfg.min_replicas}-{cfg.max_replicas}" if cfg.autoscale else cfg.replicas
        print(f"[triton-llm] {count} replica(s) ({cfg.replica_cpus:g} Ray CPUs each, ingress "
              f"{cfg.ingress_cpus:g}) serving on http://{args.host}:{args.shim_port}; Ctrl-C to stop",
              flush=True)
        threading.Event().wait()                        # until a signal raises _Stopped
    except ClusterRefused as exc:
        print(f"serve --replicas: {exc}", file=sys.stderr)
        return 2
    except _Stopped:
        pass
    finally:
        _teardown(running, local=token_dir is not None)
        if token_dir is not None:
            reap_local(token_dir)
            remove_token(token_dir)
    return 0


def _check_keys(args: argparse.Namespace) -> None:
    """The shim's own refusal (no keys on a host beyond loopback), before Ray starts, not in the
    ingress replica after a minute of deployment."""
    from client.shim.settings import MissingAPIKeys, ShimSettings, load_keys

    try:
        load_keys(ShimSettings(**shim_fields(args)))
    except MissingAPIKeys as exc:
        raise ClusterRefused(str(exc)) from None


def _teardown(running: bool, local: bool) -> None:
    """Serve's graceful shutdown once the app ran (on a joined cluster, always: it is not ours to
    kill), then Ray's. A second signal cuts the first step short."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        _on_signals(signal.SIG_IGN)
        return
    try:
        if running or not local:
            serve.shutdown()
    except _Stopped:
        print("[triton-llm] second signal: not waiting for the replicas to drain", file=sys.stderr, flush=True)
    finally:
        _on_signals(signal.SIG_IGN)
        ray.shutdown()


def add_arguments(sv: argparse.ArgumentParser) -> None:
    """``serve``'s scale-out flags (triton_llm/cli.py adds them; only ``--replicas`` turns Ray on)."""
    g = sv.add_argument_group("scale-out on Ray Serve (docs/scale_out.md)")
    g.add_argument("--replicas", type=int, default=None,
                   help="run N tritonserver replicas behind the shim on Ray Serve (needs ray[serve])")
    g.add_argument("--min-replicas", type=int, default=None, help="autoscaling lower bound")
    g.add_argument("--max-replicas", type=int, default=None,
                   help="autoscale between --min-replicas and this on ongoing requests")
    g.add_argument("--target-ongoing", type=float, default=4.0,
                   help="autoscaling target: ongoing requests per replica")
    g.add_argument("--upscale-delay", type=float, default=5.0, help="seconds above target before adding a replica")
    g.add_argument("--downscale-delay", type=float, default=30.0,
                   help="seconds below target before removing one (it drains first)")
    g.add_argument("--replica-cpus", type=float, default=None,
                   help="Ray CPUs per engine replica (default: this host's CPUs less the ingress's, shared "
                        "equally; on a joined cluster, its CPUs now)")
    g.add_argument("--ingress-cpus", type=float, default=None,
                   help="Ray CPUs of the shim ingress (default: 0.5, at most a quarter of the CPUs)")
    g.add_argument("--ray-address-insecure", action="store_true",
                   help="join the RAY_ADDRESS cluster even without Ray token auth (RAY_AUTH_MODE=token "
                        "and a token): anyone who reaches such a cluster runs code on it")
    g.add_argument("--default-router", action="store_true",
                   help="Ray's power-of-two-choices router instead of the prefix-aware one")
    g.add_argument("--prefill-replicas", type=int, default=None,
                   help="prefill/decode disaggregation: this many role=prefill replicas; the --replicas "
                        "pool decodes (KV over TCP between them, docs/disaggregation.md)")
    g.add_argument("--fallback-model", default=None, help="lighter checkpoint served under overload/failure")
    g.add_argument("--fallback-tenant", action="append", default=None, metavar="TENANT",
                   help="tenant whose requests may degrade to the fallback model ('*' = all), repeatable; "
                        "any request may opt in with the header 'x-allow-fallback: 1'")
    g.add_argument("--fallback-name", default=None,
                   help="model name fallback responses carry (default: <served model>-fallback)")
    g.add_argument("--fallback-max-ongoing", type=float, default=8.0,
                   help="primary ongoing requests per replica past which it is saturated")
    g.add_argument("--fallback-queue-s", type=float, default=2.0,
                   help="primary engine queue time (recent) past which it is saturated")
