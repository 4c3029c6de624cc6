"""API keys, tenants, settings, the command line, and what app.state offers the chat page."""
from __future__ import annotations

import asyncio
import io
import logging

import httpx
import pytest

from client.fake_client import REPLY, FakeLLMClient
from client.shim import ShimSettings, create_app
from client.shim.tenants import KeyStore
from client.shim.errors import OpenAIError
from client.shim.settings import (build_parser, default_tenant, load_keys, parse_key_lines,
                                  settings_from_args)


def test_key_file_and_env(tmp_path, monkeypatch):
    f = tmp_path / "keys"
    f.write_text("# comment\nsk-a:acme\n\nsk-b\n  sk-c : globex  \n")
    monkeypatch.setenv("TRITON_LLM_API_KEYS", "sk-d:acme, sk-e")
    keys = load_keys(ShimSettings(api_keys_file=str(f)))
    assert {k: p.tenant for k, p in keys.items()} == {
        "sk-a": "acme", "sk-b": default_tenant("sk-b"), "sk-c": "globex", "sk-d": "acme",
        "sk-e": default_tenant("sk-e")}
    assert default_tenant("sk-b") != default_tenant("sk-e") and "sk-b" not in default_tenant("sk-b")
    assert parse_key_lines([]) == {}


def test_compare_checks_every_key(monkeypatch):
    import client.shim.tenants as auth

    seen = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: seen.append(b) or real(a, b))
    store = KeyStore({"k1": "t1", "k2": "t2", "k3": "t3"})
    assert store.tenant_of("k1") == "t1"        # found first, still compared with all three
    assert len(seen) == 3
    assert store.tenant_of("nope") is None


def run_app(app, fn):
    async def go():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                return await fn(c)
    return asyncio.run(go())


def test_open_mode_warns_and_allows(caplog):
    fake = FakeLLMClient()
    app = create_app(ShimSettings(model_name="m"), client=fake)
    body = {"model": "m", "prompt": "x", "max_tokens": 1}
    with caplog.at_level(logging.WARNING, logger="triton_llm.shim"):
        r = run_app(app, lambda c: c.post("/v1/completions", json=body))
    assert r.status_code == 200 and "API is open" in caplog.text
    assert fake.calls[-1]["params"]["tenant"] == "default"


def test_allow_shared_prefix_sends_no_tenant():
    fake = FakeLLMClient()
    app = create_app(ShimSettings(model_name="m", api_keys={"k": "acme"}, allow_shared_prefix=True), client=fake)
    r = run_app(app, lambda c: c.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1},
                                      headers={"Authorization": "Bearer k"}))
    assert r.status_code == 200 and "tenant" not in fake.calls[-1]["params"]


@pytest.mark.parametrize("header", [None, "Bearer", "Basic azpr", "Bearer wrong", "bearer  k2 "])
def test_bad_or_missing_key_is_401(header):
    app = create_app(ShimSettings(model_name="m", api_keys={"k": "acme"}), client=FakeLLMClient())
    headers = {"Authorization": header} if header else {}
    r = run_app(app, lambda c: c.get("/v1/models", headers=headers))
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"


def test_state_authenticate_and_complete_for_chat_page():
    fake = FakeLLMClient()
    app = create_app(ShimSettings(model_name="m", api_keys={"k": "acme"}), client=fake)

    async def go(_c):
        from starlette.requests import Request

        ok = Request({"type": "http", "headers": [(b"authorization", b"Bearer k")]})
        bad = Request({"type": "http", "headers": []})
        assert app.state.authenticate(ok) == "acme"
        with pytest.raises(OpenAIError) as ei:
            app.state.authenticate(bad)
        assert ei.value.status == 401
        return await app.state.complete([{"role": "user", "content": "sum up"}], max_tokens=4, tenant="acme")

    assert run_app(app, go) == REPLY[:12]
    call = fake.calls[-1]
    assert call["stream"] is False and call["params"] == {"max_tokens": 4, "temperature": 0.0, "tenant": "acme"}
    assert app.state.settings.model_name == "m"


def test_command_line_and_model_dir(tmp_path):
    """The model card's max_model_len is the server's context window (the engine's, KV pool
    clamp included), not the checkpoint's max_position_embeddings; --max-model-len overrides it."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text('{"max_position_embeddings": 512}')
    args = build_parser().parse_args(["--triton-grpc", "127.0.0.1:9", "--port", "0", "--model-dir",
                                      str(tmp_path / "ckpt"), "--allow-shared-prefix"])
    s = settings_from_args(args)
    assert s.triton_grpc == "127.0.0.1:9" and s.allow_shared_prefix and s.served_model == "ckpt"
    r = run_app(create_app(s, client=FakeLLMClient(window=384)), lambda c: c.get("/v1/models"))
    assert r.json()["data"][0] == {"id": "ckpt", "object": "model", "created": r.json()["data"][0]["created"],
                                   "owned_by": "triton-llm", "max_model_len": 384}
    r = run_app(create_app(s, client=FakeLLMClient(window=None)), lambda c: c.get("/v1/models/ckpt"))
    assert r.status_code == 200 and "max_model_len" not in r.json()      # the server cannot say yet
    s = settings_from_args(build_parser().parse_args(["--model-dir", str(tmp_path / "ckpt"),
                                                      "--max-model-len", "256"]))
    r = run_app(create_app(s, client=FakeLLMClient(window=384)), lambda c: c.get("/v1/models/ckpt"))
    assert r.json()["max_model_len"] == 256


def test_chat_cli_streams_keeps_history_and_stops_on_ctrl_c():
    from client.chat_cli import run_chat
    from client.wire import Chunk

    class Client:
        def __init__(self):
            self.seen = []

        def generate(self, messages=None, params=None):
            self.seen.append([dict(m) for m in messages])
            if len(self.seen) == 1:
                yield Chunk(text="Hi")
                yield Chunk(text=" there", finish_reason="stop")
            else:
                yield Chunk(text="par")
                raise KeyboardInterrupt          # Ctrl-C while the answer streams

    client = Client()
    out = io.StringIO()
    assert run_chat(client, max_tokens=8, inp=io.StringIO("hello\nmore\n/quit\n"), out=out) == 0
    assert "Hi there" in out.getvalue() and "[stopped]" in out.getvalue()
    assert client.seen[1] == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hi there"},
                              {"role": "user", "content": "more"}]


def test_keys_are_checked_on_the_event_loop_not_in_a_worker_thread(monkeypatch):
    """The key check runs in the request's own task: a thread-pool hop per request cost ~0.3 ms
    before the first token (FastAPI runs plain ``def`` dependencies in its pool)."""
    import threading

    threads = []
    real = KeyStore.identify
    monkeypatch.setattr(KeyStore, "identify", lambda self, request: threads.append(
        threading.current_thread()) or real(self, request))
    app = create_app(ShimSettings(model_name="m", api_keys={"k": "acme"}), client=FakeLLMClient())

    async def go(c):
        loop_thread = threading.current_thread()
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1, "stream": True},
                         headers={"Authorization": "Bearer k"})
        return r, loop_thread

    r, loop_thread = run_app(app, go)
    assert r.status_code == 200 and "data: [DONE]" in r.text
    assert threads == [loop_thread]
