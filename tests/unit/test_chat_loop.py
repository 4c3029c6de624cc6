"""Chat API work that grows with what a tenant stores runs off the shim's event loop: listing a
tenant's conversations (up to its quota of them) makes as many Python calls on the loop's thread
for 150 conversations as for one; the JSON is made in the thread pool."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
from fastapi import FastAPI

from client.chat import mount_chat
from client.shim.errors import install_handlers
from client.shim.tenants import InFlight, KeyStore, parse_key_entry
from tests.unit.loop_helpers import loop_calls


def make_app(tmp_path) -> FastAPI:
    app = FastAPI()
    install_handlers(app)
    keys = KeyStore(dict([parse_key_entry("key-a:alice")]))
    app.state.keys, app.state.in_flight, app.state.authenticate = keys, InFlight(), keys.authenticate
    mount_chat(app, SimpleNamespace(chat_db_path=str(tmp_path / "chat.sqlite"), max_model_len=256,
                                    model_name="tiny", model_dir=None))
    return app


def test_listing_conversations_costs_the_loop_the_same_for_one_or_many(tmp_path):
    app = make_app(tmp_path)
    store = app.state.chat_store

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     headers={"Authorization": "Bearer key-a"}) as http:
            store.create_conversation("alice", title="first", system_prompt="be brief")
            await http.get("/api/conversations")                  # first use of the route and client
            one = await loop_calls(lambda: http.get("/api/conversations"))
            for i in range(149):
                store.create_conversation("alice", title=f"chat {i}", params={"temperature": 0.5})
            many = await loop_calls(lambda: http.get("/api/conversations"))
        return one, many

    (few_calls, one), (many_calls, many) = asyncio.run(scenario())
    assert one.status_code == many.status_code == 200
    assert [c["title"] for c in one.json()["data"]] == ["first"]
    listed = many.json()["data"]
    assert len(listed) == 150 and {c["title"] for c in listed} >= {"first", "chat 0", "chat 148"}
    assert listed[0].keys() == one.json()["data"][0].keys() and listed[0]["params"] == {"temperature": 0.5}
    assert many_calls <= few_calls * 1.5, (few_calls, many_calls)
