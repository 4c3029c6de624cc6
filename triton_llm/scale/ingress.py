"""``ShimIngress``: the OpenAI shim (client/shim, unchanged) as the Ray Serve HTTP ingress.

The shim app is built inside the ingress replica (``__serve_build_asgi_app__``) with a ServeClient
in place of the gRPC client, so auth, tenants, limits, SSE and the chat page are exactly those of
``triton-llm serve``; only where a request's stream comes from changes. Ray's HTTP proxy forwards
to this replica and cancels it when the HTTP client disconnects, which unwinds the shim's stream
and, through ServeClient, the replica's gRPC stream (explicit abort in the engine).

``GET /scale/stats`` (API key required when keys are configured) reports the routers' decisions by
policy, fallbacks and per-replica load as this ingress sees them. Around the shim app, served.py's
``ServedModel`` reads the per-request fallback opt-in header and names the serving model in the
response (``model`` field, ``x-served-model`` header). With a prefill pool (app.py
``prefill_replicas``) the shim's client is a DisaggLLMClient over two ServeClients, prefill and
primary (decode).
"""
from __future__ import annotations

from fastapi import Depends, Request
from ray import serve

from triton_llm.scale import metrics as metrics_mod
from triton_llm.scale.loopback import bind_replica_grpc_to_loopback

bind_replica_grpc_to_loopback()                     # in the replica process, before Serve binds it


class ShimIngress:
    def __init__(self, primary, fallback=None, *, model_dir: str, block_size: int = 16,
                 prefix_routing: bool = True, shim: dict | None = None,
                 fallback_tenants: list[str] | None = None, fallback_max_ongoing: float = 8.0,
                 fallback_queue_s: float = 2.0, fallback_model_name: str | None = None,
                 prefill=None) -> None:
        self.primary, self.fallback, self.prefill = primary, fallback, prefill
        self.model_dir, self.block_size, self.prefix_routing = model_dir, block_size, prefix_routing
        self.shim = dict(shim or {})
        self.fallback_tenants = set(fallback_tenants or [])
        self.fallback_max_ongoing, self.fallback_queue_s = fallback_max_ongoing, fallback_queue_s
        self.fallback_model_name = fallback_model_name

    def __serve_build_asgi_app__(self):
        from triton_llm.scale.fallback import FallbackPolicy
        from triton_llm.scale.prefix_key import PrefixKeyer
        from triton_llm.scale.served import ServedModel
        from triton_llm.scale.serve_client import ServeClient
        from client.shim.app import create_app
        from client.shim.settings import ShimSettings

        keyer = PrefixKeyer(self.model_dir, self.block_size) if self.prefix_routing else None
        client = ServeClient(self.primary, keyer=keyer, fallback=self.fallback,
                             fallback_policy=FallbackPolicy(self.fallback_max_ongoing, self.fallback_queue_s),
                             fallback_tenants=self.fallback_tenants)
        front = client
        if self.prefill is not None:             # disaggregated: prefill pool first, then primary (decode)
            from client.disagg_client import DisaggLLMClient

            front = DisaggLLMClient(ServeClient(self.prefill, keyer=keyer), client)
        settings = ShimSettings(model_dir=self.model_dir, **self.shim)
        app = create_app(settings, client=front)
        fallback_name = None
        if self.fallback is not None:
            fallback_name = self.fallback_model_name or f"{settings.served_model}-fallback"
        app.add_middleware(ServedModel, primary_name=settings.served_model, fallback_name=fallback_name)

        def _auth(request: Request):
            return app.state.keys.identify(request)

        @app.get("/scale/stats")
        async def scale_stats(_key=Depends(_auth)):
            routers = [m.snapshot() for m in metrics_mod.LIVE]
            return {"routers": routers, "fallbacks": client.metrics.snapshot()["fallbacks"],
                    "served": dict(client.served), "retries": dict(client.retries), "ongoing_primary": client.ongoing,
                    "primary_queue_time_s": round(client.queue_time.current(), 3),
                    "running_primaries": client._healthy,
                    "disagg": None if front is client else {"handovers": front.handovers, "kept": front.kept,
                                                            "served_prefill": dict(front.prefill.served)}}

        return app


ShimIngressDeployment = serve.deployment(serve.ingress()(ShimIngress), name="ShimIngress")
