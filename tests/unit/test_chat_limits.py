"""Limits of the chat API (issue 30): per-tenant quotas are 429s in OpenAI's error shape, the
token-count cache stays bounded, token counting runs off the event loop and is linear in the
conversation, a summary's model call holds one of the key's max_concurrent slots at the key's
priority ceiling, and chat.sqlite is private to its owner."""
from __future__ import annotations

import asyncio
import os
import stat
import threading
from types import SimpleNamespace

import httpx
from fastapi import FastAPI
from fastapi.testclient import TestClient

from client.chat import mount_chat
from client.chat.context import ContextBuilder, TokenCounter
from client.chat.store import ChatStore, TenantQuota
from client.chat.tokens import CountCache
from client.shim.errors import install_handlers
from client.shim.tenants import InFlight, KeyStore, parse_key_entry

A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}


class CountingCounter(TokenCounter):
    """The real counter, noting every tokenizer call and the thread it ran on."""

    def __init__(self):
        self.calls, self.threads = 0, set()
        super().__init__()

    def encode(self, text):
        self.calls += 1
        self.threads.add(threading.get_ident())
        return super().encode(text)


def make_app(tmp_path, *, complete=None, keys=("key-a:alice max_concurrent=1 priority=3", "key-b:bob"),
             max_model_len=256, **settings) -> FastAPI:
    app = FastAPI()
    install_handlers(app)                      # the shim's OpenAI error shape (429s, 401s)
    store = KeyStore(dict(parse_key_entry(k) for k in keys))
    app.state.keys, app.state.in_flight = store, InFlight()
    app.state.authenticate = store.authenticate
    app.state.complete = complete
    mount_chat(app, SimpleNamespace(chat_db_path=str(tmp_path / "chat.sqlite"), max_model_len=max_model_len,
                                    model_name="tiny", model_dir=None, chat_keep_turns=2, **settings))
    return app


def assert_quota_error(r, param=None):
    assert r.status_code == 429, r.text
    assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "insufficient_quota",
                                  "param": param, "code": "insufficient_quota"}}


def test_conversation_quota_is_a_429_per_tenant(tmp_path):
    with TestClient(make_app(tmp_path, chat_max_conversations=2)) as http:
        ids = [http.post("/api/conversations", json={}, headers=A).json()["id"] for _ in range(2)]
        r = http.post("/api/conversations", json={}, headers=A)
        assert_quota_error(r)
        assert "quota is 2" in r.json()["error"]["message"]
        assert http.post("/api/conversations", json={}, headers=B).status_code == 201   # bob's own
        assert http.delete(f"/api/conversations/{ids[0]}", headers=A).status_code == 204
        assert http.post("/api/conversations", json={}, headers=A).status_code == 201


def test_byte_quota_refuses_the_message_that_would_pass_it(tmp_path):
    with TestClient(make_app(tmp_path, chat_max_bytes=1000, max_model_len=4096)) as http:
        conv = http.post("/api/conversations", json={}, headers=A).json()["id"]
        first = http.post(f"/api/conversations/{conv}/messages", json={"content": "é" * 300}, headers=A)
        assert first.status_code == 201, first.text                      # 600 bytes
        r = http.post(f"/api/conversations/{conv}/messages",
                      json={"role": "assistant", "content": "x" * 401}, headers=A)
        assert_quota_error(r, "content")
        tree = http.get(f"/api/conversations/{conv}", headers=A).json()
        assert [m["content"] for m in tree["messages"]] == ["é" * 300]       # nothing else written
        store = http.app.state.chat_store
        assert store.usage("alice") == (1, 600) and store.usage("bob") == (0, 0)
        assert http.post(f"/api/conversations/{conv}/messages",
                         json={"role": "assistant", "content": "x" * 400}, headers=A).status_code == 201
        assert http.delete(f"/api/conversations/{conv}", headers=A).status_code == 204
        assert store.usage("alice") == (0, 0)


def test_usage_survives_reopening_and_is_filled_in_for_old_databases(tmp_path):
    path = str(tmp_path / "old.sqlite")
    s = ChatStore(path)
    conv = s.create_conversation("t").id
    s.add_message("t", conv, role="user", content="hello", parent_id=None)
    s._db.execute("ALTER TABLE conversations DROP COLUMN bytes")         # a database from before
    s.close()
    s = ChatStore(path, TenantQuota(max_conversations=1, max_bytes=10))
    assert s.usage("t") == (1, 5)
    s.close()


def test_token_count_cache_is_bounded_and_holds_no_text():
    c = CountCache(max_bytes=CountCache.ENTRY_BYTES * 50)
    counter = TokenCounter()
    counter._counts = c
    big = "word " * 20_000
    for i in range(500):
        n = counter.message("user", f"{i} {big}" if i % 100 == 0 else f"message {i}")
        assert len(c) <= 50 and c.bytes <= CountCache.ENTRY_BYTES * 50
    assert n == counter.count_exact([{"role": "user", "content": "message 499"}]) - counter.count([])
    assert all(isinstance(k, bytes) and len(k) == 16 for k in c._items)


def test_counting_is_linear_and_off_the_event_loop(tmp_path):
    store = ChatStore(str(tmp_path / "c.sqlite"))
    counter = CountingCounter()
    calls = []

    async def complete(messages, *, max_tokens, tenant):
        calls.append(messages)
        return "short summary"

    def encodes_for(turns: int) -> int:
        conv = store.create_conversation("t", policy="summarize", keep_turns=2).id
        leaf = None
        for i in range(turns):
            u = store.add_message("t", conv, role="user", content=f"q{i} " + "word " * 30, parent_id=leaf)
            leaf = store.add_message("t", conv, role="assistant", content=f"a{i} " + "text " * 30,
                                     parent_id=u.id).id
        leaf = store.add_message("t", conv, role="user", content="last", parent_id=leaf).id
        builder = ContextBuilder(store, counter, max_model_len=256, complete=complete, summary_tokens=32)
        before = counter.calls

        async def run():
            counter.threads.discard(threading.get_ident())
            r = await builder.build("t", store.get_conversation("t", conv), leaf)
            return r, threading.get_ident()

        r, loop_thread = asyncio.run(run())
        assert r.summary == "short summary" and loop_thread not in counter.threads
        return counter.calls - before

    small, large = encodes_for(20), encodes_for(80)
    assert large <= 4 * small + 20, (small, large)       # quadratic would be ~16x
    store.close()


def test_summarize_holds_a_max_concurrent_slot_at_the_keys_priority(tmp_path):
    """alice's key allows 1 open request at priority >= 3: while one summary call is open, a
    second conversation's summary is the key's 429, and the summary ran at priority 3."""
    release, seen = asyncio.Event(), []

    async def complete(messages, *, max_tokens, tenant, priority=0):
        seen.append((tenant, priority))
        await release.wait()
        return "summary"

    app = make_app(tmp_path, complete=complete)
    store = app.state.chat_store
    convs = []
    for _ in range(2):
        conv = store.create_conversation("alice", policy="summarize", keep_turns=1, max_tokens=32).id
        leaf = None
        for i in range(6):
            u = store.add_message("alice", conv, role="user", content=f"question {i} " + "w " * 40,
                                  parent_id=leaf)
            leaf = store.add_message("alice", conv, role="assistant", content="answer " + "r " * 40,
                                     parent_id=u.id).id
        convs.append(conv)
    key_a = app.state.keys.policy_of("key-a")

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            first = asyncio.create_task(http.post(f"/api/conversations/{convs[0]}/messages",
                                                  json={"content": "go on"}, headers=A))
            while not seen:                               # the summary call is open, holding the slot
                await asyncio.sleep(0.01)
            held = app.state.in_flight.count(key_a)
            second = await http.post(f"/api/conversations/{convs[1]}/messages",
                                     json={"content": "and this?"}, headers=A)
            release.set()
            return held, await first, second

    held, first, second = asyncio.run(scenario())
    assert held == 1 and app.state.in_flight.count(key_a) == 0
    assert first.status_code == 201 and set(seen) == {("alice", 3)}
    assert second.status_code == 429 and second.json()["error"]["type"] == "rate_limit_error"
    assert [m.content for m in store.path("alice", convs[1])][-1] != "and this?"    # taken back


def test_chat_sqlite_is_created_owner_only(tmp_path):
    path = tmp_path / "chat.sqlite"
    s = ChatStore(str(path))
    conv = s.create_conversation("t").id
    s.add_message("t", conv, role="user", content="secret", parent_id=None)
    for f in (path, tmp_path / "chat.sqlite-wal"):
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f
    s.close()
    loose = tmp_path / "loose.sqlite"
    loose.touch(mode=0o644)
    os.chmod(loose, 0o644)
    ChatStore(str(loose)).close()
    assert stat.S_IMODE(os.stat(loose).st_mode) == 0o600
