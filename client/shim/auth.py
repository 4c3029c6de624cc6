"""Bearer API keys, compared in constant time; every key belongs to a tenant (prefix-cache salt)."""
from __future__ import annotations

import hmac

from fastapi import Request

from client.shim.errors import unauthorized

OPEN_TENANT = "default"


class KeyStore:
    def __init__(self, keys: dict[str, str]) -> None:
        self._keys = [(k.encode(), t) for k, t in keys.items()]

    @property
    def open(self) -> bool:
        return not self._keys

    def tenant_of(self, key: str) -> str | None:
        """The key's tenant or None; compares against every key so timing reveals nothing."""
        given = key.encode()
        found = None
        for k, tenant in self._keys:
            if hmac.compare_digest(given, k):
                found = tenant
        return found

    def authenticate(self, request: Request) -> str:
        """The request's tenant; raises the 401 OpenAIError."""
        if self.open:
            return OPEN_TENANT
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise unauthorized()
        tenant = self.tenant_of(token.strip())
        if tenant is None:
            raise unauthorized()
        return tenant
