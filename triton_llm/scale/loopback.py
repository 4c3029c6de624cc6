"""Ray Serve 2.60 starts each replica's inter-deployment gRPC server on every interface (``[::]:0``,
hard-coded in ``ray.serve._private.replica``). Ray's token guards it, yet on a single-machine
cluster (node address 127.0.0.1: ``serve --replicas``, triton_llm/scale/ray_cluster.py) no peer
exists beyond loopback, so there it binds 127.0.0.1, the address Serve's routers dial (the
replica's node IP). On a multi-node cluster it is left as Ray has it.

``triton_llm/scale/replica.py`` and ``ingress.py`` call :func:`bind_replica_grpc_to_loopback` at import,
which in a replica process happens before Serve starts that server.
"""
from __future__ import annotations

import ipaddress


def _node_is_loopback() -> bool:
    try:
        import ray
        return ipaddress.ip_address(ray.util.get_node_ip_address()).is_loopback
    except Exception:                               # noqa: BLE001 -- not in Ray / no address: leave it
        return False


def bind_replica_grpc_to_loopback() -> None:
    try:
        from ray.serve._private import replica as serve_replica
    except ImportError:
        return
    original = getattr(serve_replica, "add_port_to_grpc_server", None)
    if original is None or getattr(original, "tllm_loopback", False):
        return

    def add_port(server, address: str):
        if address.startswith("[::]:") and _node_is_loopback():
            address = "127.0.0.1:" + address.rsplit(":", 1)[1]
        return original(server, address)

    add_port.tllm_loopback = True
    serve_replica.add_port_to_grpc_server = add_port
