"""Stored Responses for ``previous_response_id``: a bounded in-memory LRU per tenant.

A stored response keeps the *chat messages* of its whole conversation (everything before it, its
input, and its own output as an assistant message), never the instructions (OpenAI does not carry
them over). A continuation sends those messages again with the new input appended, so its prompt
is the previous prompt plus the previous answer plus the new turn: the same token prefix, served
from the engine's prefix cache for that tenant.

Bounds: per tenant, at most ``max_items`` responses and ``max_bytes`` of their JSON; the least
recently used go first. A tenant sees only its own ids (another tenant's id is "not found"). All
tenants together hold at most ``max_total_bytes`` (the least recently active tenant's oldest go
first) and ``max_tenants`` tenants (the least recently active one is dropped whole). Lost on
restart, as a cache is.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class StoredResponse:
    messages: list[dict]            # the conversation up to and including this response's output
    body: dict | None               # the response object itself (GET /v1/responses/{id})
    size: int                       # bytes of both as JSON (what the bounds count)


class ResponseStore:
    def __init__(self, max_items: int = 1024, max_bytes: int = 64 << 20, max_tenants: int = 256,
                 max_total_bytes: int = 256 << 20) -> None:
        self.max_items, self.max_bytes, self.max_tenants = max_items, max_bytes, max_tenants
        self.max_total_bytes = max_total_bytes
        self._tenants: OrderedDict[str, OrderedDict[str, StoredResponse]] = OrderedDict()
        self._bytes: dict[str, int] = {}
        self._lock = threading.Lock()

    def put(self, tenant: str, response_id: str, messages: list[dict], body: dict | None = None) -> bool:
        """Keep ``messages`` (and the response ``body``) under ``response_id``; False if one response
        alone is over the bound."""
        size = len(json.dumps([messages, body], ensure_ascii=False).encode())
        if size > min(self.max_bytes, self.max_total_bytes):
            return False
        with self._lock:
            items = self._tenants.pop(tenant, None)
            if items is None:
                items = OrderedDict()
                self._bytes[tenant] = 0
            self._tenants[tenant] = items                  # most recently active last
            old = items.pop(response_id, None)
            if old is not None:
                self._bytes[tenant] -= old.size
            items[response_id] = StoredResponse(messages, body, size)
            self._bytes[tenant] += size
            while len(items) > self.max_items or self._bytes[tenant] > self.max_bytes:
                _, gone = items.popitem(last=False)
                self._bytes[tenant] -= gone.size
            while len(self._tenants) > self.max_tenants:
                dropped, _ = self._tenants.popitem(last=False)
                del self._bytes[dropped]
            while sum(self._bytes.values()) > self.max_total_bytes:
                oldest, items = next(iter(self._tenants.items()))
                _, gone = items.popitem(last=False)
                self._bytes[oldest] -= gone.size
                if not items:
                    del self._tenants[oldest], self._bytes[oldest]
        return True

    def get(self, tenant: str, response_id: str) -> list[dict] | None:
        with self._lock:
            items = self._tenants.get(tenant)
            if items is None or response_id not in items:
                return None
            items.move_to_end(response_id)
            return [dict(m) for m in items[response_id].messages]

    def body(self, tenant: str, response_id: str) -> dict | None:
        with self._lock:
            found = self._tenants.get(tenant, {}).get(response_id)
            return None if found is None else found.body

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock:
            items = self._tenants.get(tenant)
            if items is None or response_id not in items:
                return False
            self._bytes[tenant] -= items.pop(response_id).size
            return True

    def stats(self, tenant: str) -> tuple[int, int]:
        """(responses, bytes) held for ``tenant``."""
        with self._lock:
            return len(self._tenants.get(tenant, ())), self._bytes.get(tenant, 0)
