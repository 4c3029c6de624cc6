"""The connector the engine options name: the factory above the connector implementations (the
interface, backend/disagg/connector.py, knows none of them)."""
from __future__ import annotations

from backend.disagg.connector import KVConnector
from backend.disagg.secret import load_secret
from backend.disagg.shm import SharedMemoryConnector
from backend.disagg.tcp import TcpConnector


def make_connector(args) -> KVConnector:
    """The connector ``args`` (backend.config.DisaggConfig) names: kv_connector; for tcp
    kv_connector_host / _port and the shared secret read from kv_secret_file."""
    if args.kv_connector == "shm":
        return SharedMemoryConnector()
    secret = load_secret(args.kv_secret_file) if args.kv_secret_file else None
    return TcpConnector(args.kv_connector_host, args.kv_connector_port, secret=secret)
