"""The Responses store: per-tenant LRU bounded by count and bytes, tenants isolated and bounded."""
from __future__ import annotations

import json

from client.shim.response_store import ResponseStore


def msgs(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def size(m: list[dict], body: dict | None = None) -> int:
    return len(json.dumps([m, body], ensure_ascii=False).encode())


def test_count_bound_drops_the_least_recently_used():
    s = ResponseStore(max_items=2, max_bytes=10_000)
    for rid in ("a", "b"):
        s.put("t", rid, msgs(rid))
    assert s.get("t", "a") == msgs("a")                 # a is now the most recent
    s.put("t", "c", msgs("c"))
    assert s.get("t", "b") is None and s.get("t", "a") == msgs("a") and s.get("t", "c") == msgs("c")
    assert s.stats("t") == (2, size(msgs("a")) + size(msgs("c")))


def test_byte_bound_and_oversized_item():
    one = size(msgs("x" * 100))
    s = ResponseStore(max_items=100, max_bytes=2 * one + 10)
    for rid in "abc":
        s.put("t", rid, msgs("x" * 100))
    assert [s.get("t", r) is not None for r in "abc"] == [False, True, True]
    assert s.stats("t") == (2, 2 * one)
    assert s.put("t", "huge", msgs("y" * 10_000)) is False and s.get("t", "huge") is None
    assert s.stats("t") == (2, 2 * one)


def test_tenants_are_isolated_and_bounded():
    s = ResponseStore(max_items=10, max_bytes=10_000, max_tenants=2)
    s.put("acme", "r1", msgs("secret"))
    assert s.get("globex", "r1") is None and s.delete("globex", "r1") is False
    s.put("globex", "r2", msgs("g"))
    s.get("acme", "r1")                                 # reads do not change which tenant is oldest
    s.put("initech", "r3", msgs("i"))
    assert s.stats("acme") == (0, 0) and s.get("globex", "r2") == msgs("g")
    assert s.delete("initech", "r3") is True and s.stats("initech") == (1 - 1, 0)


def test_get_returns_a_copy():
    s = ResponseStore()
    s.put("t", "r", msgs("a"))
    got = s.get("t", "r")
    got[0]["content"] = "changed"
    got.append({"role": "user", "content": "more"})
    assert s.get("t", "r") == msgs("a")


def test_total_bytes_bound_takes_from_the_least_recently_active_tenant():
    one = size(msgs("x" * 100))
    s = ResponseStore(max_items=100, max_bytes=10 * one, max_total_bytes=3 * one)
    s.put("acme", "a1", msgs("x" * 100))
    s.put("acme", "a2", msgs("x" * 100))
    s.put("globex", "g1", msgs("x" * 100))
    s.put("globex", "g2", msgs("x" * 100))              # over: acme (least recently active) gives up a1
    assert s.get("acme", "a1") is None and s.get("acme", "a2") is not None
    s.put("globex", "g3", msgs("x" * 100))              # over again: acme's last one, then acme is gone
    assert s.stats("acme") == (0, 0) and s.stats("globex") == (3, 3 * one)


def test_the_body_is_kept_and_counted():
    s = ResponseStore()
    body = {"id": "r", "object": "response", "output": [{"type": "message"}]}
    s.put("t", "r", msgs("a"), body)
    assert s.body("t", "r") == body and s.body("u", "r") is None
    assert s.stats("t") == (1, size(msgs("a"), body))
