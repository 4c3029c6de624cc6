"""``ScaleConfig`` and ``build_app``: the Ray Serve application for ``triton-llm serve --replicas``.

    ShimIngress (HTTP, OpenAI API) ──handle──► TritonReplica × N   (primary model, PrefixAwareRouter)
                                   ├─handle──► TritonReplica × M   (fallback model, optional)
                                   └─handle──► PrefillReplica × P  (prefill/decode disaggregation, optional)

With ``prefill_replicas`` > 0 the primary pool runs ``role=decode`` and P replicas of the same
checkpoint run ``role=prefill``: the ingress sends a new request to a prefill replica and its
continuation, with the hand-over record, to a decode replica (client/disagg_client.py over two
ServeClients), which fetches the prompt's KV from the prefill replica over the TCP connector
(the two pools may sit on different nodes). Both pools route by prefix.

Replica counts: fixed ``replicas``, or autoscaling between ``min_replicas`` and ``max_replicas``
on Ray Serve's ongoing-requests target with upscale/downscale delays. Scale-in and shutdown drain
a replica: Ray stops routing to it and waits up to ``graceful_shutdown_s`` for its open requests
before its tritonserver is stopped.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from backend.disagg.secret import new_secret
from triton_llm.scale.ingress import ShimIngressDeployment
from triton_llm.scale.replica import TritonReplica

ROUTER_CLASS = "triton_llm.scale.router:PrefixAwareRouter"


@dataclass
class ScaleConfig:
    model_dir: str
    engine_options: dict = field(default_factory=dict)
    replicas: int = 2
    autoscale: bool = False
    min_replicas: int = 1
    max_replicas: int = 2
    target_ongoing_requests: float = 4.0
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 30.0
    autoscale_look_back_s: float = 30.0        # window Ray averages ongoing requests over
    autoscale_metrics_interval_s: float = 10.0 # how often replicas/handles report them
    max_ongoing_requests: int = 64             # per replica: past it Ray queues in the router
    prefix_routing: bool = True                # False: Ray's default power-of-two-choices router
    imbalance: int = 4                         # load bound of the prefix router (ongoing requests)
    affinity_min_blocks: int = 2               # shortest prefix match (KV blocks) the router follows
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0                  # 1 on GPU nodes: one engine per GPU
    ingress_cpus: float = 0.5
    ingress_max_ongoing: int = 1024            # the shim limits per key itself; Ray's default is 5
    health_check_period_s: float = 2.0
    health_check_timeout_s: float = 10.0
    graceful_shutdown_s: float = 30.0
    fallback_model_dir: str | None = None
    fallback_engine_options: dict = field(default_factory=dict)
    fallback_replicas: int = 1
    fallback_tenants: list[str] = field(default_factory=list)   # "*": every request may degrade
    fallback_max_ongoing: float = 8.0          # primary ongoing requests per replica that saturate it
    fallback_queue_s: float = 2.0              # primary engine queue time (recent max) that saturates it
    fallback_model_name: str | None = None     # the name responses carry; default "<served>-fallback"
    prefill_replicas: int = 0                  # > 0: disaggregate; the primary pool decodes
    shim: dict = field(default_factory=dict)   # ShimSettings fields (api_keys_file, model_name, ...)

    @property
    def block_size(self) -> int:
        return int(self.engine_options.get("block_size", 16))


def _replica_options(cfg: ScaleConfig, name: str, replicas: int, autoscale: bool) -> dict:
    opts = dict(name=name, max_ongoing_requests=cfg.max_ongoing_requests,
                ray_actor_options={"num_cpus": cfg.replica_cpus, "num_gpus": cfg.replica_gpus},
                health_check_period_s=cfg.health_check_period_s,
                health_check_timeout_s=cfg.health_check_timeout_s,
                graceful_shutdown_timeout_s=cfg.graceful_shutdown_s,
                graceful_shutdown_wait_loop_s=1.0)
    if autoscale:
        opts["autoscaling_config"] = AutoscalingConfig(
            min_replicas=cfg.min_replicas, max_replicas=cfg.max_replicas, initial_replicas=cfg.min_replicas,
            target_ongoing_requests=cfg.target_ongoing_requests,
            upscale_delay_s=cfg.upscale_delay_s, downscale_delay_s=cfg.downscale_delay_s,
            look_back_period_s=cfg.autoscale_look_back_s, metrics_interval_s=cfg.autoscale_metrics_interval_s)
    else:
        opts["num_replicas"] = replicas
    return opts


def role_options(engine_options: dict, role: str, kv_secret: str | None = None) -> dict:
    """A pool's engine options under disaggregation: its role, KV over TCP between replicas
    (the prefill side's address is its node's: replica.py), authenticated by the app's
    ``kv_secret`` (replica.py writes it to a 0600 file: docs/disaggregation.md)."""
    return {**engine_options, "role": role, "kv_connector": "tcp", **({"kv_secret": kv_secret} if kv_secret else {})}


def build_app(cfg: ScaleConfig):
    def routed(opts: dict) -> dict:
        if cfg.prefix_routing:
            opts["request_router_config"] = RequestRouterConfig(
                request_router_class=ROUTER_CLASS,
                request_router_kwargs={"imbalance": cfg.imbalance, "min_blocks": cfg.affinity_min_blocks})
        return opts

    disagg = cfg.prefill_replicas > 0
    kv_secret = new_secret() if disagg else None        # one per app: its prefill and decode pools share it
    primary_opts = routed(_replica_options(cfg, "TritonReplica", cfg.replicas, cfg.autoscale))
    primary = serve.deployment(TritonReplica).options(**primary_opts).bind(
        cfg.model_dir, role_options(cfg.engine_options, "decode", kv_secret) if disagg else cfg.engine_options, "primary")
    prefill = None
    if disagg:
        pf_opts = routed(_replica_options(cfg, "PrefillReplica", cfg.prefill_replicas, False))
        prefill = serve.deployment(TritonReplica).options(**pf_opts).bind(
            cfg.model_dir, role_options(cfg.engine_options, "prefill", kv_secret), "prefill")
    fallback = None
    if cfg.fallback_model_dir:
        fb_opts = _replica_options(cfg, "FallbackReplica", cfg.fallback_replicas, False)
        fallback = serve.deployment(TritonReplica).options(**fb_opts).bind(
            cfg.fallback_model_dir, cfg.fallback_engine_options, "fallback")
    return ShimIngressDeployment.options(ray_actor_options={"num_cpus": cfg.ingress_cpus},
                                         max_ongoing_requests=cfg.ingress_max_ongoing).bind(
        primary, fallback, model_dir=cfg.model_dir, block_size=cfg.block_size,
        prefix_routing=cfg.prefix_routing, shim=cfg.shim, fallback_tenants=cfg.fallback_tenants,
        fallback_max_ongoing=cfg.fallback_max_ongoing, fallback_queue_s=cfg.fallback_queue_s,
        fallback_model_name=cfg.fallback_model_name, prefill=prefill)


def app_builder(args: dict):
    """Ray Serve's config-file entry (``import_path: triton_llm.scale.app:app_builder``, ``args`` = the
    ScaleConfig fields), used by docker/kuberay/rayservice.yaml and ``serve run``."""
    return build_app(ScaleConfig(**args))
