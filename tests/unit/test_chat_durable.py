"""Durable chats: an SQLite file (WAL) that survives a shim restart, refused messages taken back,
size caps, and SQLite work off the event loop."""
from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import httpx
import pytest

from client.chat.validation import MAX_CONTENT_CHARS, MAX_JSON_CHARS, MAX_SYSTEM_PROMPT_CHARS
from client.fake_client import FakeLLMClient
from client.shim import ShimSettings, create_app
from client.shim.background import free_port
from client.shim.settings import DEFAULT_CHAT_DB, build_parser

KEY = "sk-chat"
H = {"Authorization": f"Bearer {KEY}"}


def run(app, fn):
    async def go():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                         timeout=30) as c:
                return await fn(c)
    return asyncio.run(go())


@pytest.fixture
def app(tmp_path):
    settings = ShimSettings(model_name="m", api_keys={KEY: "acme"}, max_model_len=200,
                            chat_db_path=str(tmp_path / "chat.sqlite"))
    return create_app(settings, client=FakeLLMClient(window=200))


def test_refused_message_is_taken_back(app):
    async def go(c):
        conv = (await c.post("/api/conversations", json={}, headers=H)).json()["id"]
        ok = await c.post(f"/api/conversations/{conv}/messages", json={"content": "hello"}, headers=H)
        u1 = ok.json()["message"]["id"]
        a1 = (await c.post(f"/api/conversations/{conv}/messages", headers=H,
                           json={"role": "assistant", "content": "hi", "parent_id": u1})).json()["message"]["id"]
        r = await c.post(f"/api/conversations/{conv}/messages", json={"content": "word " * 400}, headers=H)
        assert r.status_code == 400 and r.json()["error"]["param"] == "content"
        r = await c.post(f"/api/conversations/{conv}/messages/{u1}/edit", json={"content": "word " * 400},
                         headers=H)
        assert r.status_code == 400
        tree = (await c.get(f"/api/conversations/{conv}", headers=H)).json()
        assert tree["conversation"]["current_leaf_id"] == a1 and tree["path"] == [u1, a1]
        assert [m["id"] for m in tree["messages"]] == [u1, a1]          # nothing dangles
        # a refused first message leaves an empty conversation, still titled "New chat"
        conv2 = (await c.post("/api/conversations", json={}, headers=H)).json()["id"]
        r = await c.post(f"/api/conversations/{conv2}/messages", json={"content": "word " * 400}, headers=H)
        assert r.status_code == 400
        tree = (await c.get(f"/api/conversations/{conv2}", headers=H)).json()
        assert tree["messages"] == [] and tree["conversation"]["current_leaf_id"] is None
        assert tree["conversation"]["title"] == "New chat"
    run(app, go)


def test_size_caps(app):
    async def go(c):
        r = await c.post("/api/conversations", json={"system_prompt": "s" * (MAX_SYSTEM_PROMPT_CHARS + 1)},
                         headers=H)
        assert r.status_code == 400 and r.json()["error"]["param"] == "system_prompt"
        r = await c.post("/api/conversations", json={"title": "t" * 201}, headers=H)
        assert r.status_code == 400 and r.json()["error"]["param"] == "title"
        r = await c.post("/api/conversations", json={"params": {"stop": ["x" * 300]}}, headers=H)
        assert r.status_code == 400 and r.json()["error"]["param"] == "params"
        r = await c.post("/api/conversations", json={"params": {"seed": 2 ** 70}}, headers=H)
        assert r.status_code == 400 and r.json()["error"]["param"] == "params"
        conv = (await c.post("/api/conversations", json={}, headers=H)).json()["id"]
        r = await c.post(f"/api/conversations/{conv}/messages", json={"content": "x" * (MAX_CONTENT_CHARS + 1)},
                         headers=H)
        assert r.status_code == 400 and r.json()["error"]["param"] == "content"
        u = (await c.post(f"/api/conversations/{conv}/messages", json={"content": "hi"}, headers=H)).json()
        r = await c.post(f"/api/conversations/{conv}/messages", headers=H,
                         json={"role": "assistant", "content": "ok", "parent_id": u["message"]["id"],
                               "stats": {"junk": "j" * MAX_JSON_CHARS}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stats"
    run(app, go)


def test_store_work_runs_off_the_event_loop(app):
    """A slow SQLite call must not stall the loop: /health answers while it runs.

    Deterministic (no durations compared): the store call blocks until the test releases it after
    /health answered. Run on the event loop, it would block the loop, /health could answer only
    after the call gave up waiting (30 s) and returned, and ``inside`` would be False by then."""
    store = app.state.chat_store
    real = store.list_conversations
    entered, release = threading.Event(), threading.Event()
    inside = []

    def slow(tenant):
        inside.append(True)
        entered.set()
        try:
            release.wait(timeout=30)
            return real(tenant)
        finally:
            inside.clear()

    store.list_conversations = slow

    async def go(c):
        listing = asyncio.create_task(c.get("/api/conversations", headers=H))
        while not entered.is_set() and not listing.done():      # the store call has started
            await asyncio.sleep(0.01)
        health = await c.get("/health")
        answered_while_inside = bool(inside)
        release.set()
        assert (await listing).status_code == 200
        return health.status_code, answered_while_inside
    assert run(app, go) == (200, True)


def test_cli_default_is_a_file_under_the_serve_workdir():
    args = build_parser().parse_args([])
    assert args.chat_db == str(DEFAULT_CHAT_DB) and DEFAULT_CHAT_DB.parent.name == "serve"


def _start(db, port):
    cmd = [sys.executable, "-m", "client.shim", "--triton-grpc", f"127.0.0.1:{free_port()}",
           "--port", str(port), "--max-model-len", "256", "--chat-db", str(db), "--log-level", "warning"]
    env = {**os.environ, "TRITON_LLM_API_KEYS": f"{KEY}:acme"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180               # imports take long on a loaded 2-core CI host
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    raise RuntimeError(f"shim did not start (exit code {proc.returncode})")


def _stop(proc):
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=15)


def test_conversations_survive_a_shim_restart(tmp_path):
    db = tmp_path / "serve" / "chat.sqlite"          # the directory is made on start
    proc, url = _start(db, free_port())
    try:
        conv = httpx.post(url + "/api/conversations", json={"system_prompt": "be brief"}, headers=H).json()["id"]
        r = httpx.post(f"{url}/api/conversations/{conv}/messages", json={"content": "remember me"},
                       headers=H, timeout=60)
        assert r.status_code == 201, r.text
    finally:
        _stop(proc)
    with sqlite3.connect(db) as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    proc, url = _start(db, free_port())
    try:
        tree = httpx.get(f"{url}/api/conversations/{conv}", headers=H).json()
        assert tree["conversation"]["system_prompt"] == "be brief"
        assert [m["content"] for m in tree["messages"]] == ["remember me"]
        assert tree["conversation"]["title"] == "remember me"
        assert httpx.get(f"{url}/api/conversations/{conv}",
                         headers={"Authorization": "Bearer other"}).status_code == 401
    finally:
        _stop(proc)
