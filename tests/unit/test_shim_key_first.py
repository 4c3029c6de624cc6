"""Attacks on the shim's front door that now fail: an anonymous body is refused before it is read,
an open shim will not listen beyond loopback, and model output nested past any sane depth stays
text instead of a RecursionError (a 500)."""
from __future__ import annotations

import json
import socket

import httpx
import pytest

from client.fake_client import FakeLLMClient
from client.shim import ShimSettings, create_app
from client.shim.background import BackgroundServer
from client.shim.settings import MissingAPIKeys, build_parser, load_keys, settings_from_args
from client.shim.tools import MAX_JSON_DEPTH, json_depth, parse_tool_calls

KEY = "sk-front-door"


@pytest.fixture(scope="module")
def server():
    fake = FakeLLMClient()
    # A body timeout far past the socket timeout below: a server that waited for the body would
    # make recv time out, so an answer at all proves the body was never awaited.
    settings = ShimSettings(model_name="tiny", api_keys={KEY: "acme"}, body_timeout_s=600.0)
    with BackgroundServer(create_app(settings, client=fake)) as srv:
        yield srv, fake


def _headers_only(srv, path: str, auth: bytes = b"") -> bytes:
    """Send a POST's headers declaring a 1 MB body, never the body; return the server's whole answer
    (it closes the connection)."""
    with socket.create_connection((srv.host, srv.port)) as s:
        s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  + auth + b"Content-Length: 1000000\r\n\r\n")
        s.settimeout(60)
        answer = b""
        while chunk := s.recv(65536):    # until the server closes: headers and body may come apart
            answer += chunk
        return answer


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages",
                                  "/v1/responses", "/v1/embeddings", "/api/conversations"])
@pytest.mark.parametrize("auth", [b"", b"Authorization: Bearer sk-wrong\r\n", b"x-api-key: sk-wrong\r\n",
                                  b"Authorization: Basic " + KEY.encode() + b"\r\n"])
def test_a_body_without_a_valid_key_is_refused_before_it_is_read(server, path, auth):
    srv, fake = server
    calls = len(fake.calls)
    answer = _headers_only(srv, path, auth)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert b"connection: close" in answer.lower()
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    if path == "/v1/messages":                       # Anthropic's error shape on its route
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    else:
        assert body["error"]["code"] == "invalid_api_key"
    assert len(fake.calls) == calls


def test_a_valid_key_in_either_header_still_reaches_the_routes(server):
    srv, fake = server
    base = f"http://{srv.host}:{srv.port}"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = httpx.post(base + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    r = httpx.post(base + "/v1/messages", json=body, headers={"x-api-key": KEY})
    assert r.status_code == 200, r.text
    assert httpx.get(base + "/health").status_code == 200       # GETs need no key to be routed


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.7", "::", "example.com", ""])
def test_an_open_shim_refuses_a_host_beyond_loopback(host, monkeypatch):
    monkeypatch.delenv("TRITON_LLM_API_KEYS", raising=False)
    monkeypatch.delenv("TRITON_LLM_INSECURE_NO_API_KEYS", raising=False)
    with pytest.raises(MissingAPIKeys, match="not loopback.*--insecure-no-api-keys"):
        create_app(ShimSettings(host=host), client=FakeLLMClient())
    args = build_parser().parse_args(["--host", host or "0.0.0.0", "--insecure-no-api-keys"])
    assert load_keys(settings_from_args(args)) == {}             # said explicitly: it starts open
    assert load_keys(ShimSettings(host=host, api_keys={KEY: "t"}))           # with keys: fine


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_an_open_shim_on_loopback_still_starts(host, monkeypatch):
    monkeypatch.delenv("TRITON_LLM_API_KEYS", raising=False)
    assert load_keys(ShimSettings(host=host)) == {}


def test_the_command_line_refuses_an_open_public_shim(monkeypatch, capsys):
    from client.shim.__main__ import main

    monkeypatch.delenv("TRITON_LLM_API_KEYS", raising=False)
    monkeypatch.delenv("TRITON_LLM_INSECURE_NO_API_KEYS", raising=False)
    assert main(["--host", "0.0.0.0", "--port", "1", "--chat-db", ":memory:"]) == 2
    assert "not loopback" in capsys.readouterr().err


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 50_000])
def test_tool_calls_nested_too_deep_stay_text(depth):
    deep = "[" * depth + "]" * depth
    # a block in no header shape, parsed whole
    text = f'<tool_call>\n{{"name": "f", "arguments": {deep}, "x": 1}}\n</tool_call>'.replace(
        '{"name": "f", "arguments"', '{"arguments"', 1)
    content, calls = parse_tool_calls(text)
    assert calls == [] and content == text
    # arguments that are not an object, taken raw at the end of the block
    raw = '<tool_call>\n{"name": "f", "arguments": ' + '"s"' + ' ' + deep + '}\n</tool_call>'
    content, calls = parse_tool_calls(raw)
    assert [c["name"] for c in calls] == ["f"] and isinstance(calls[0]["arguments"], str)


def test_tool_calls_within_the_depth_still_parse():
    ok = "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1)      # the call object is one more
    content, calls = parse_tool_calls(f'<tool_call>\n{{"arguments": {ok}, "name": "f"}}\n</tool_call>')
    assert content == "" and calls[0]["name"] == "f" and json.loads(calls[0]["arguments"]) == json.loads(ok)
    assert json_depth('{"a": "[[[[", "b": [{"c": []}]}') == 4        # brackets inside strings do not count


def test_anthropic_tool_input_nested_too_deep_is_kept_raw():
    from client.shim.anthropic_format import _input

    deep = "[" * 50_000 + "]" * 50_000
    assert _input(deep) == {"_raw": deep}
    assert _input('{"city": "Paris"}') == {"city": "Paris"}
