"""REST API of the chat page on a small app that provides what the shim provides
(``app.state.authenticate`` and ``app.state.complete``)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi import FastAPI, HTTPException, Request
from fastapi.testclient import TestClient

from client.chat import mount_chat

KEYS = {"key-a": "alice", "key-b": "bob"}
A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}


@pytest.fixture
def app(tmp_path):
    app = FastAPI()

    def authenticate(request: Request) -> str:
        token = request.headers.get("authorization", "").removeprefix("Bearer ")
        if token not in KEYS:
            raise HTTPException(401, "bad key")
        return KEYS[token]

    calls = []

    async def complete(messages, *, max_tokens, tenant):
        calls.append((messages, max_tokens, tenant))
        return "they talked"

    app.state.authenticate = authenticate
    app.state.complete = complete
    app.state.calls = calls
    settings = SimpleNamespace(chat_db_path=str(tmp_path / "chat.sqlite3"), max_model_len=1024,
                               model_name="tiny", model_dir=None, chat_keep_turns=4)
    mount_chat(app, settings)
    return app


@pytest.fixture
def http(app):
    with TestClient(app) as c:
        yield c


def say(http, conv, text, parent="__leaf__", headers=A):
    body = {"role": "user", "content": text}
    if parent != "__leaf__":
        body["parent_id"] = parent
    r = http.post(f"/api/conversations/{conv}/messages", json=body, headers=headers)
    assert r.status_code == 201, r.text
    return r.json()


def reply(http, conv, parent, text, **extra):
    r = http.post(f"/api/conversations/{conv}/messages", headers=A,
                  json={"role": "assistant", "content": text, "parent_id": parent, **extra})
    assert r.status_code == 201, r.text
    return r.json()["message"]


def test_page_and_static_files(http):
    page = http.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert '<script type="module" src="/static/chat/app.js">' in page.text
    from client.chat import STATIC

    names = {p.name for p in STATIC.iterdir()}
    assert {"app.js", "api.js", "stream.js", "models.js", "style.css"} <= names
    for name in sorted(names):
        assert http.get(f"/static/chat/{name}").status_code == 200
    assert "http://" not in page.text and "https://" not in page.text   # no CDN


def test_conversation_lifecycle(http):
    assert http.get("/api/config", headers=A).json() == {
        "model": "tiny", "max_model_len": 1024, "default_policy": "truncate",
        "default_keep_turns": 4, "policies": ["truncate", "summarize"]}
    r = http.post("/api/conversations", json={}, headers=A)
    assert r.status_code == 201
    conv = r.json()
    assert (conv["title"], conv["keep_turns"], conv["policy"]) == ("New chat", 4, "truncate")
    out = say(http, conv["id"], "What is   the capital\nof France?")
    assert out["message"]["parent_id"] is None and out["message"]["role"] == "user"
    assert out["context"]["messages"] == [{"role": "user", "content": "What is   the capital\nof France?"}]
    assert out["context"]["max_tokens"] == 256 and out["context"]["params"] == {}
    # The first message names the conversation.
    assert http.get(f"/api/conversations/{conv['id']}", headers=A).json()["conversation"]["title"] \
        == "What is the capital of France?"
    r = http.patch(f"/api/conversations/{conv['id']}", headers=A,
                   json={"title": "Geography", "system_prompt": "Be brief.", "max_tokens": 32,
                         "params": {"temperature": 0.2}})
    assert r.status_code == 200 and r.json()["title"] == "Geography"
    listed = http.get("/api/conversations", headers=A).json()["data"]
    assert [c["title"] for c in listed] == ["Geography"]
    assert http.delete(f"/api/conversations/{conv['id']}", headers=A).status_code == 204
    assert http.get(f"/api/conversations/{conv['id']}", headers=A).status_code == 404
    assert http.get("/api/conversations", headers=A).json()["data"] == []


def test_branching_through_the_api(http):
    conv = http.post("/api/conversations", json={"system_prompt": "SYS"}, headers=A).json()["id"]
    u1 = say(http, conv, "one")["message"]
    a1 = reply(http, conv, u1["id"], "uno", stats={"completion_tokens": 1}, finish_reason="stop",
               context={"policy": "truncate", "applied": False})
    u2 = say(http, conv, "two")
    assert u2["message"]["parent_id"] == a1["id"]
    assert [m["content"] for m in u2["context"]["messages"]] == ["SYS", "one", "uno", "two"]
    a2 = reply(http, conv, u2["message"]["id"], "dos")
    # Edit "two": a sibling, whose context is computed from the same history.
    r = http.post(f"/api/conversations/{conv}/messages/{u2['message']['id']}/edit",
                  json={"content": "TWO"}, headers=A)
    assert r.status_code == 201
    edited = r.json()
    assert edited["message"]["parent_id"] == a1["id"]
    assert [m["content"] for m in edited["context"]["messages"]] == ["SYS", "one", "uno", "TWO"]
    a2b = reply(http, conv, edited["message"]["id"], "DOS")
    tree = http.get(f"/api/conversations/{conv}", headers=A).json()
    byid = {m["id"]: m for m in tree["messages"]}
    assert tree["path"] == [u1["id"], a1["id"], edited["message"]["id"], a2b["id"]]
    assert byid[a1["id"]]["children"] == [u2["message"]["id"], edited["message"]["id"]]
    assert tree["root_ids"] == [u1["id"]]
    assert byid[a1["id"]]["stats"] == {"completion_tokens": 1}
    # Switch back to the first branch: the path descends to its reply.
    r = http.put(f"/api/conversations/{conv}/leaf", json={"message_id": u2["message"]["id"]}, headers=A)
    assert r.json() == {"current_leaf_id": a2["id"], "path": [u1["id"], a1["id"],
                                                              u2["message"]["id"], a2["id"]]}
    # Regenerate "dos": the context for its user message, then a sibling reply.
    ctx = http.get(f"/api/conversations/{conv}/context", params={"leaf_id": u2["message"]["id"]},
                   headers=A).json()
    assert [m["content"] for m in ctx["messages"]] == ["SYS", "one", "uno", "two"]
    again = reply(http, conv, u2["message"]["id"], "dos!", stopped=True, finish_reason="abort")
    msg = http.get(f"/api/conversations/{conv}/messages/{again['id']}", headers=A).json()
    assert msg["stopped"] is True and msg["finish_reason"] == "abort"
    assert http.get(f"/api/conversations/{conv}/messages/{u2['message']['id']}",
                    headers=A).json()["children"] == [a2["id"], again["id"]]


def test_errors_are_openai_shaped(http):
    conv = http.post("/api/conversations", json={}, headers=A).json()["id"]
    r = http.post("/api/conversations", json={"policy": "nope"}, headers=A)
    assert r.status_code == 400 and r.json()["error"]["param"] == "policy"
    r = http.post("/api/conversations", json={"colour": "red"}, headers=A)
    assert r.status_code in (400, 422)
    r = http.post(f"/api/conversations/{conv}/messages", headers=A,
                  json={"role": "assistant", "content": "x", "parent_id": None})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = http.get(f"/api/conversations/{conv}/context", headers=A)
    assert r.status_code == 400 and r.json()["error"]["param"] == "leaf_id"
    r = http.put(f"/api/conversations/{conv}/leaf", json={"message_id": "msg_missing"}, headers=A)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = http.post(f"/api/conversations/{conv}/messages", headers=A,
                  json={"role": "user", "content": "word " * 2000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "content"
    assert "max_model_len 1024" in r.json()["error"]["message"]


def test_tenants_are_isolated(http):
    conv = http.post("/api/conversations", json={"title": "alice's"}, headers=A).json()["id"]
    u = say(http, conv, "private")["message"]
    assert http.get("/api/conversations", headers=B).json()["data"] == []
    for method, path, body in (
            ("GET", f"/api/conversations/{conv}", None),
            ("PATCH", f"/api/conversations/{conv}", {"title": "bob's now"}),
            ("DELETE", f"/api/conversations/{conv}", None),
            ("POST", f"/api/conversations/{conv}/messages", {"content": "hi"}),
            ("POST", f"/api/conversations/{conv}/messages/{u['id']}/edit", {"content": "hi"}),
            ("GET", f"/api/conversations/{conv}/messages/{u['id']}", None),
            ("GET", f"/api/conversations/{conv}/context", None),
            ("PUT", f"/api/conversations/{conv}/leaf", {"message_id": u["id"]})):
        r = http.request(method, path, json=body, headers=B)
        assert r.status_code == 404, (method, path, r.status_code)
    # Bob cannot graft onto Alice's message from his own conversation either.
    mine = http.post("/api/conversations", json={}, headers=B).json()["id"]
    r = http.post(f"/api/conversations/{mine}/messages", headers=B,
                  json={"role": "assistant", "content": "x", "parent_id": u["id"]})
    assert r.status_code == 404
    assert http.get(f"/api/conversations/{conv}", headers=A).json()["conversation"]["title"] == "alice's"
    assert http.get("/api/conversations", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert http.get("/api/conversations").status_code == 401


def test_summarize_through_the_api(http, app):
    conv = http.post("/api/conversations", json={"policy": "summarize", "keep_turns": 1},
                     headers=A).json()["id"]
    u = say(http, conv, "first")["message"]
    reply(http, conv, u["id"], "ok")
    out = say(http, conv, "second")
    ctx = out["context"]
    assert (ctx["policy"], ctx["applied"], ctx["summarized_turns"], ctx["summary"]) == \
        ("summarize", True, 1, "they talked")
    assert ctx["messages"][0]["role"] == "system" and "they talked" in ctx["messages"][0]["content"]
    assert [(m[1], m[2]) for m in app.state.calls] == [(128, "alice")]
    http.get(f"/api/conversations/{conv}/context", headers=A)
    assert len(app.state.calls) == 1


def test_context_window_comes_from_the_server(tmp_path):
    """Without max_model_len the page uses the server's context window (the engine's, KV pool clamp
    included), not the checkpoint's max_position_embeddings; a 503 while the server cannot say."""
    from client.fake_client import FakeLLMClient
    from client.shim.app import create_app
    from client.shim.settings import ShimSettings

    fake = FakeLLMClient(window=None)
    settings = ShimSettings(model_dir=None, chat_db_path=str(tmp_path / "c.sqlite3"))
    with TestClient(create_app(settings, client=fake)) as c:
        assert c.get("/api/config").status_code == 503
        fake.window = 200
        assert c.get("/api/config").json()["max_model_len"] == 200
        conv = c.post("/api/conversations", json={}).json()["id"]
        r = c.post(f"/api/conversations/{conv}/messages", json={"role": "user", "content": "hi"})
        assert r.status_code == 201 and r.json()["context"]["max_model_len"] == 200
        conv = c.post("/api/conversations", json={}).json()["id"]
        r = c.post(f"/api/conversations/{conv}/messages", json={"role": "user", "content": "word " * 300})
        assert r.status_code == 400 and "max_model_len 200" in r.json()["error"]["message"]
