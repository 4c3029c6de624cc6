"""API keys: who the caller is (``KeyStore``: bearer keys compared in constant time; ``KeyFirst``,
the middleware that refuses a body from a caller without a valid key before a byte of it is read;
``authenticated``, the routes' dependency) and what the key may do: its tenant, its priority
ceiling, and how many requests it may have open.

A keys-file line (also one comma-separated entry of env TRITON_LLM_API_KEYS)::

    KEY[:TENANT] [priority=P] [max_concurrent=N] [admin=1]

- ``tenant`` goes to Triton as the ``tenant`` request parameter: the engine salts the prefix cache
  with it and enforces its per-tenant running/waiting limits by it.
- ``priority`` (default 0; lower = sooner) is the key's default and the most urgent priority its
  requests may ask for: a client may only lower its own priority (send a larger number).
- ``max_concurrent`` (default: no limit) bounds the key's open generation requests in this shim;
  one more is a 429 with ``Retry-After`` before any work is done.
- ``admin=1`` lets the key use the admin routes (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``);
  no other key, and no caller of a shim without keys, may.
"""
from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass

from fastapi import Request

from client.shim.errors import OpenAIError, invalid, unauthorized
from client.shim.limits import PRIORITY_MAX, PRIORITY_MIN, send_error

OPEN_TENANT = "default"
_OPTION = re.compile(r"^[a-z_]+=")


@dataclass(frozen=True)
class KeyPolicy:
    tenant: str
    priority: int = 0
    max_concurrent: int | None = None
    key_id: str = ""                 # names the key in the concurrency count (never the key itself)
    admin: bool = False              # may use the admin routes (client/shim/lora_routes.py)


OPEN = KeyPolicy(OPEN_TENANT, key_id="open")


def default_tenant(key: str) -> str:
    """A key listed without a tenant is its own tenant; the key itself is never sent."""
    return "key-" + _digest(key)


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def parse_key_entry(entry: str) -> tuple[str, KeyPolicy] | None:
    """One ``KEY[:TENANT] [priority=P] [max_concurrent=N]`` entry; None for a blank or ``#`` one.
    Raises ValueError naming the bad option (the shim refuses to start on a bad keys file)."""
    line = entry.strip()
    if not line or line.startswith("#"):
        return None
    tokens = line.split()
    opts: list[str] = []
    while len(tokens) > 1 and _OPTION.match(tokens[-1]):     # the first token is always the key
        opts.insert(0, tokens.pop())
    key, _, tenant = " ".join(tokens).partition(":")
    key, tenant = key.strip(), tenant.strip()
    if not key:
        return None
    values: dict[str, int] = {}
    for opt in opts:
        name, eq, value = opt.partition("=")
        if name not in ("priority", "max_concurrent", "admin") or not eq:
            raise ValueError(f"API key entry for tenant {tenant or '(own)'}: unknown option {opt!r} "
                             "(expected priority=P, max_concurrent=N or admin=1)")
        try:
            values[name] = int(value)
        except ValueError:
            raise ValueError(f"API key option {name} must be an integer, got {value!r}") from None
    priority = values.get("priority", 0)
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise ValueError(f"API key option priority must be in [{PRIORITY_MIN}, {PRIORITY_MAX}]")
    limit = values.get("max_concurrent")
    if limit is not None and limit < 1:
        raise ValueError("API key option max_concurrent must be at least 1")
    if values.get("admin", 0) not in (0, 1):
        raise ValueError("API key option admin must be 0 or 1")
    return key, KeyPolicy(tenant or default_tenant(key), priority, limit, _digest(key), bool(values.get("admin")))


def as_policy(key: str, value) -> KeyPolicy:
    """``ShimSettings.api_keys`` values: a tenant name or a KeyPolicy."""
    if isinstance(value, KeyPolicy):
        return value if value.key_id else KeyPolicy(value.tenant, value.priority,
                                                    value.max_concurrent, _digest(key), value.admin)
    return KeyPolicy(str(value) or default_tenant(key), key_id=_digest(key))


def effective_priority(policy: KeyPolicy, asked: int | None) -> int:
    """The priority a request runs at; 400 when it asks to be more urgent than its key allows."""
    if asked is None:
        return policy.priority
    if asked < policy.priority:
        raise invalid(f"priority {asked} is more urgent than this API key allows (at most "
                      f"{policy.priority}; lower is sooner, so send a number >= {policy.priority})",
                      "priority")
    return asked


class InFlight:
    """Open generation requests per key (an event-loop counter: no lock needed)."""

    def __init__(self) -> None:
        self._open: dict[str, int] = {}

    def count(self, policy: KeyPolicy) -> int:
        return self._open.get(policy.key_id, 0)

    def acquire(self, policy: KeyPolicy) -> "Slot":
        """A held slot, or the 429 when the key already has ``max_concurrent`` requests open."""
        n = self._open.get(policy.key_id, 0)
        if policy.max_concurrent is not None and n >= policy.max_concurrent:
            raise OpenAIError(429, f"This API key already has {n} requests open (its limit is "
                                   f"{policy.max_concurrent}); retry when one has finished.",
                              "rate_limit_error", None, "rate_limit_exceeded", {"Retry-After": "1"})
        self._open[policy.key_id] = n + 1
        return Slot(self, policy.key_id)

    def _release(self, key_id: str) -> None:
        n = self._open.get(key_id, 0) - 1
        if n > 0:
            self._open[key_id] = n
        else:
            self._open.pop(key_id, None)


class Slot:
    """One open request's hold on its key's count; ``release()`` is idempotent."""

    def __init__(self, owner: InFlight, key_id: str) -> None:
        self._owner, self._key_id, self._held = owner, key_id, True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._owner._release(self._key_id)


async def authenticated(request: Request) -> KeyPolicy:
    """The caller's key policy (the routes' dependency), so a bad key is a 401 before the body is
    validated. ``async`` on purpose: FastAPI runs a plain ``def`` dependency in its thread pool,
    a thread hand-off and back on every request (~0.3 ms before the first token at 1 stream) for
    a few constant-time compares."""
    return request.app.state.keys.identify(request)


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

    def admits(self, headers) -> bool:
        """Whether raw ASGI ``headers`` carry a valid key: ``Authorization: Bearer KEY`` or, as
        Anthropic's clients send it, ``x-api-key: KEY``. The routes still decide which they take."""
        if self.open:
            return True
        for name, value in headers:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer" and token.strip() and self.policy_of(token.strip()):
                    return True
            elif name == b"x-api-key":
                token = value.decode("latin-1").strip()
                if token and self.policy_of(token):
                    return True
        return False


class KeyFirst:
    """ASGI middleware, outside the body limit: a request that may carry a body (anything but GET,
    HEAD, OPTIONS) without a valid key gets its 401 before the body is read or parsed, so an
    anonymous caller costs no buffering, no JSON parse and no model work. GETs reach their routes,
    which authenticate as before (the chat page's HTML and /health need no key)."""

    def __init__(self, app, keys: KeyStore) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS")
                or self.keys.admits(scope.get("headers", ()))):
            await self.app(scope, receive, send)
            return
        err = unauthorized("Incorrect or missing API key. Send it as 'Authorization: Bearer KEY' "
                           "(or 'x-api-key: KEY').")
        err.headers = {**err.headers, "Connection": "close"}     # the unread body dies with it
        await send_error(send, err, scope.get("path", ""))
