"""Addresses: whether a bind keeps a port on this machine."""
from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the port on this machine ("localhost", 127.0.0.0/8, ::1); a
    name, "" or "0.0.0.0" counts as reachable from outside."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
