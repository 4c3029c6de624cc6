"""Bearer API keys, compared in constant time; every key has a policy (client/shim/tenants.py):
its tenant (the prefix-cache salt and the engine's fairness unit), priority ceiling and
concurrency limit."""
from __future__ import annotations

import hmac

from fastapi import Request

from client.shim.errors import unauthorized
from client.shim.tenants import OPEN, OPEN_TENANT, KeyPolicy, as_policy

__all__ = ["KeyStore", "OPEN_TENANT"]


class KeyStore:
    def __init__(self, keys: dict) -> None:
        self._keys = [(k.encode(), as_policy(k, v)) for k, v in keys.items()]

    @property
    def open(self) -> bool:
        return not self._keys

    def policy_of(self, key: str) -> KeyPolicy | None:
        """The key's policy or None; compares against every key so timing reveals nothing."""
        given = key.encode()
        found = None
        for k, policy in self._keys:
            if hmac.compare_digest(given, k):
                found = policy
        return found

    def tenant_of(self, key: str) -> str | None:
        policy = self.policy_of(key)
        return None if policy is None else policy.tenant

    def identify(self, request: Request) -> KeyPolicy:
        """The request's key policy; raises the 401 OpenAIError."""
        if self.open:
            return OPEN
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise unauthorized()
        policy = self.policy_of(token.strip())
        if policy is None:
            raise unauthorized()
        return policy

    def authenticate(self, request: Request) -> str:
        """The request's tenant; raises the 401 OpenAIError."""
        return self.identify(request).tenant
