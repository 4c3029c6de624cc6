"""Bounded inputs: body size (413 before parsing; a keyless body is a 401 before that), n, prompt lists, prompt characters,
int64 / range checks and stop strings are 400s from the shim before any generation starts."""
from __future__ import annotations

import time

import httpx
import pytest

from client.errors import InvalidRequestError
from client.fake_client import FakeLLMClient
from client.shim import ShimSettings, create_app
from client.shim.background import BackgroundServer
from client.wire import to_parameters

KEY = "sk-limits"
H = {"Authorization": f"Bearer {KEY}"}
LIMIT = 64 * 1024
WINDOW = 256


@pytest.fixture(scope="module")
def fake():
    return FakeLLMClient(window=WINDOW)


@pytest.fixture(scope="module")
def url(fake):
    settings = ShimSettings(model_name="tiny", api_keys={KEY: "acme"}, max_body_bytes=LIMIT,
                            prompt_chars_per_token=4)
    with BackgroundServer(create_app(settings, client=fake)) as srv:
        yield srv.url


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_body_over_the_limit_is_413_before_parsing(url, fake):
    calls = len(fake.calls)
    big = b'{"model": "tiny", "prompt": "' + b"x" * LIMIT + b'"}'
    # no key at all: refused before its size matters (test_shim_key_first.py: before it is read)
    e = error(httpx.post(url + "/v1/completions", content=big,
                         headers={"content-type": "application/json"}), 401)
    assert e["code"] == "invalid_api_key"
    e = error(httpx.post(url + "/v1/completions", content=big, headers={**H, "content-type": "application/json"}), 413)
    assert e["code"] == "request_too_large" and str(LIMIT) in e["message"]
    # chunked (no Content-Length): counted while read, refused once past the limit
    def chunks():
        for _ in range(LIMIT // 1024 + 8):
            yield b" " * 1024
    r = httpx.post(url + "/v1/completions", content=chunks(), headers=H)
    assert error(r, 413)["code"] == "request_too_large"
    e = error(httpx.post(url + "/api/conversations", content=big, headers=H), 413)
    assert len(fake.calls) == calls
    # just under the limit still works
    ok = {"model": "tiny", "prompt": "x" * 100, "max_tokens": 1}
    assert httpx.post(url + "/v1/completions", json=ok, headers=H).status_code == 200


@pytest.mark.parametrize("field, value", [
    ("n", 1_000_000_000), ("n", 17), ("n", 0), ("max_tokens", 2 ** 63), ("max_tokens", 0),
    ("seed", 2 ** 63), ("seed", -(2 ** 63) - 1), ("top_k", 2 ** 40), ("top_k", -2),
    ("min_tokens", -1), ("min_tokens", 2 ** 64), ("priority", 2 ** 31), ("logprobs", 21),
    ("stop_token_ids", [2 ** 31]), ("stop_token_ids", list(range(65))), ("stop", ["a"] * 5),
    ("stop", "x" * 257), ("prompt", []), ("prompt", ["p"] * 33), ("max_tokens", 10 ** 400),
])
def test_out_of_range_is_a_quick_400_naming_the_field(url, fake, field, value):
    calls = len(fake.calls)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2, field: value}
    # no wall-clock bound (a loaded CI host is 5-10x slower); a shim that hangs on the value (issue
    # 19: n = 1e9 built a 23 GB choice array) times out instead of answering
    e = error(httpx.post(url + "/v1/completions", json=body, headers=H, timeout=30), 400)
    assert e["param"].split(".")[0] == field and e["type"] == "invalid_request_error", e
    assert len(fake.calls) == calls               # nothing was generated, no choices were made


@pytest.mark.parametrize("field, value", [
    ("n", 1_000_000_000), ("max_completion_tokens", 2 ** 63), ("top_logprobs", 21), ("seed", 2 ** 70),
])
def test_chat_out_of_range_is_400(url, fake, field, value):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
            field: value}
    calls = len(fake.calls)
    for stream in (False, True):
        e = error(httpx.post(url + "/v1/chat/completions", json={**body, "stream": stream}, headers=H), 400)
        assert e["param"] == field
    assert len(fake.calls) == calls


def test_non_finite_floats_are_400(url):
    for literal in (b"NaN", b"Infinity", b"-Infinity", b"1e999"):
        body = b'{"model": "tiny", "prompt": "x", "temperature": ' + literal + b"}"
        r = httpx.post(url + "/v1/completions", content=body,
                       headers={**H, "content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] in ("temperature", None), r.text


def test_extreme_values_inside_the_ranges_reach_the_server(url, fake):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "seed": -(2 ** 63), "top_k": -1,
            "n": 16, "stop": ["a" * 256] * 4, "logprobs": 20}
    r = httpx.post(url + "/v1/completions", json=body, headers=H)
    assert r.status_code == 200 and len(r.json()["choices"]) == 16
    assert fake.calls[-1]["params"]["seed"] == -(2 ** 63)


def test_prompt_characters_capped_at_a_multiple_of_the_window(url, fake):
    calls = len(fake.calls)
    cap = WINDOW * 4                              # prompt_chars_per_token=4
    e = error(httpx.post(url + "/v1/completions", headers=H,
                         json={"model": "tiny", "prompt": ["ok", "y" * (cap + 1)]}), 400)
    assert e["param"] == "prompt" and e["code"] == "context_length_exceeded" and str(cap) in e["message"]
    msgs = [{"role": "user", "content": "z" * (cap // 2)}, {"role": "assistant", "content": "z" * (cap // 2)}]
    e = error(httpx.post(url + "/v1/chat/completions", headers=H,
                         json={"model": "tiny", "messages": msgs}), 400)
    assert e["param"] == "messages"
    parts = [{"role": "user", "content": [{"type": "text", "text": "w" * (cap + 1)}]}]
    assert error(httpx.post(url + "/v1/chat/completions", headers=H,
                            json={"model": "tiny", "messages": parts}), 400)["param"] == "messages"
    assert len(fake.calls) == calls
    r = httpx.post(url + "/v1/completions", headers=H,
                   json={"model": "tiny", "prompt": "y" * (cap - 10), "max_tokens": 1})
    assert r.status_code == 200


def test_client_library_refuses_integers_past_int64():
    for name, value in (("max_tokens", 2 ** 63), ("seed", -(2 ** 63) - 1)):
        with pytest.raises(InvalidRequestError) as ei:
            to_parameters({name: value})
        assert ei.value.param == name
    assert to_parameters({"seed": 2 ** 63 - 1}) == {"seed": 2 ** 63 - 1}


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", b'{"model": "tiny", "prompt": "\\ud800x", "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}'),
    ("/v1/completions", b'{"model": "\\ud800", "prompt": "x"}'),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "stop": ["\\uDBFF"]}'),
    ("/api/conversations", b'{"title": "\\ud800"}'),
    ("/v1/completions", b'{"model": "tiny", "prompt": ' + b"[" * 30000 + b"]" * 30000 + b"}"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}'),
])
def test_unencodable_or_unparsable_bodies_are_400(url, fake, path, body):
    """Valid JSON that is not valid Unicode (a lone surrogate escape) once made a 500 in the gRPC
    client, the error body or SQLite; too deep or not UTF-8 at all is a parse error."""
    calls = len(fake.calls)
    error(httpx.post(url + path, content=body, headers={**H, "content-type": "application/json"}), 400)
    assert len(fake.calls) == calls
    ok = b'{"model": "tiny", "prompt": "\\ud83d\\ude00", "max_tokens": 1}'     # a proper pair
    r = httpx.post(url + "/v1/completions", content=ok, headers={**H, "content-type": "application/json"})
    assert r.status_code == 200 and fake.calls[-1]["prompt"] == "\U0001F600"


def test_a_trickling_body_is_408(fake):
    """A client that never finishes its body (slowloris) holds nothing past the body timeout."""
    import socket

    from client.shim.background import BackgroundServer

    settings = ShimSettings(model_name="tiny", api_keys={KEY: "acme"}, body_timeout_s=1.0)
    with BackgroundServer(create_app(settings, client=fake)) as srv:
        with socket.create_connection((srv.host, srv.port)) as s:
            start = time.monotonic()                    # before the server can start its timer
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer " + KEY.encode() + b"\r\n"     # keyless: a 401 at once
                      b"Content-Length: 1000\r\n\r\n{\"model\": ")
            s.settimeout(60)                            # generous: a loaded CI host is slow
            answer = b""
            while chunk := s.recv(65536):               # until it closes: headers and body may come apart
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
            # not before the body timeout (a lower bound cannot flake on a slow host); a server that
            # never times the body out leaves recv to time out and fails the test
            assert time.monotonic() - start > 0.5
