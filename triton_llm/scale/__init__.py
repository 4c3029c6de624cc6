"""Scale-out on Ray Serve (docs/scale_out.md): many tritonservers behind one OpenAI endpoint.

    policy.py       PrefixAffinityPolicy: pure prefix-affinity + load-bound replica choice
    prefix_key.py   PrefixKeyer: the leading block hashes of a rendered prompt (kv_cache/block_pool.py)
    fallback.py     FallbackPolicy: when a request goes to the lighter model
    metrics.py      RoutingMetrics: hit/miss by policy, per-replica load (Ray metrics + a snapshot)
    router.py       PrefixAwareRouter: the policy as a Ray Serve RequestRouter
    replica.py      TritonReplica: one deployment replica owning one tritonserver
    serve_client.py ServeClient: the shim's client interface over Ray deployment handles
    served.py       ServedModel: ASGI middleware, fallback opt-in header in, serving model's name out
    ingress.py      ShimIngress: the OpenAI shim as the Ray Serve HTTP ingress
    app.py          ScaleConfig, build_app(): the Ray Serve application graph
    run.py          serve_replicas(): ``triton-llm serve --replicas N``
    bench.py        prefix-hit rate, prefix router vs power-of-two choices
    bench_autoscale.py  the autoscaling load step (1 -> 16 -> 1 clients), timeline + plot

Nothing here is imported by the single-process ``triton-llm serve`` path; Ray is only needed here.
"""
