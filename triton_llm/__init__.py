"""The assembled product, above ``backend`` and ``client``: ``scale`` (Ray Serve scale-out: replicas
of the whole stack behind the shim as ingress). Nothing in backend/ or client/ imports it."""
