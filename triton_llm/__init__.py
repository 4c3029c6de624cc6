"""The assembled product, above ``backend`` and ``client``: ``cli`` (the ``triton-llm`` command:
serve, chat, import-gguf, make-model) and ``scale`` (Ray Serve scale-out: replicas of the whole
stack behind the shim as ingress). Nothing in backend/ or client/ imports it."""
