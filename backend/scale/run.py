"""``triton-llm serve --replicas N``: the Ray Serve application on this machine (or, with
``RAY_ADDRESS`` set, on an existing Ray cluster), the shim on ``--host``/``--shim-port``.

Blocks until Ctrl-C / SIGTERM, then shuts Serve down: each replica drains (graceful shutdown) and
stops its tritonserver. Ray is imported only here, so plain ``serve`` never needs it.
"""
from __future__ import annotations

import argparse
import os
import signal
import threading

from backend.serving.repository import parse_engine_options

APP_NAME = "triton-llm"


def config_from_args(args: argparse.Namespace):
    from backend.scale.app import ScaleConfig

    shim = {"api_keys_file": args.api_keys} if args.api_keys else {}
    autoscale = args.max_replicas is not None
    return ScaleConfig(
        model_dir=str(args.model), engine_options=parse_engine_options(args.engine_option),
        replicas=args.replicas, autoscale=autoscale, min_replicas=args.min_replicas or 1,
        max_replicas=args.max_replicas or args.replicas, prefix_routing=not args.default_router,
        target_ongoing_requests=args.target_ongoing, upscale_delay_s=args.upscale_delay,
        downscale_delay_s=args.downscale_delay,
        replica_cpus=args.replica_cpus, fallback_model_dir=args.fallback_model,
        fallback_tenants=list(args.fallback_tenant or []), fallback_max_ongoing=args.fallback_max_ongoing,
        fallback_queue_s=args.fallback_queue_s, fallback_model_name=args.fallback_name,
        prefill_replicas=args.prefill_replicas or 0, shim=shim)


def serve_replicas(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from backend.scale.app import build_app

    cfg = config_from_args(args)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": root}})
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.shim_port})
        serve.run(build_app(cfg), name=APP_NAME, route_prefix="/", blocking=False)
        print(f"[triton-llm] {cfg.replicas if not cfg.autoscale else f'{cfg.min_replicas}-{cfg.max_replicas}'} "
              f"replica(s) serving on http://{args.host}:{args.shim_port}", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def add_arguments(sv: argparse.ArgumentParser) -> None:
    """``serve``'s scale-out flags (backend/cli.py adds them; only ``--replicas`` turns Ray on)."""
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
    g.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs per replica")
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
