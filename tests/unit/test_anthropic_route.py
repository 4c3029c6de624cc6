"""/v1/messages against a scripted fake client, driven by the official ``anthropic`` SDK: the body
and stream shapes it parses, tool_use / tool_result, x-api-key auth, Anthropic's error shape."""
from __future__ import annotations

import anthropic
import httpx
import pytest

from client.errors import UnavailableError
from client.fake_client import FakeLLMClient
from client.shim import ShimSettings, create_app
from client.shim.background import BackgroundServer

KEY = "sk-test-1"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"name": "get_weather", "description": "weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def fake():
    return FakeLLMClient()


@pytest.fixture(scope="module")
def server(fake):
    settings = ShimSettings(model_name="tiny", api_keys={KEY: "acme"}, reasoning_parser="deepseek_r1",
                            max_body_bytes=100_000)
    with BackgroundServer(create_app(settings, client=fake)) as srv:
        yield srv


@pytest.fixture
def sdk(server, fake):
    fake.reply, fake.fail_after = "mulling</think>Hello there, friend.", None
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def test_plain_message_and_params(sdk, fake):
    m = sdk.messages.create(model="tiny", max_tokens=100, messages=MSG, system="Be brief.",
                            stop_sequences=["STOP"], extra_body={"temperature": 0.0, "top_p": 0.9, "top_k": 5})
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"]                   # thinking not asked for: dropped
    assert m.content[0].text == "Hello there, friend." and m.stop_reason == "end_turn"
    assert m.usage.output_tokens == len(fake.tokens({})[0]) and m.usage.input_tokens > 0
    call = fake.calls[-1]
    assert call["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert call["params"] == {"max_tokens": 100, "stop": ["STOP"], "temperature": 0.0, "top_p": 0.9, "top_k": 5,
                              "tenant": "acme"}
    m = sdk.messages.create(model="tiny", max_tokens=3, messages=MSG)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_stream_matches_and_thinking_blocks(sdk):
    whole = sdk.messages.create(model="tiny", max_tokens=100, messages=MSG,
                                thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in whole.content] == ["thinking", "text"] and whole.content[0].thinking == "mulling"
    events = list(sdk.messages.create(model="tiny", max_tokens=100, messages=MSG, stream=True,
                                      thinking={"type": "enabled", "budget_tokens": 1024}))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]           # the SDK drops ping
    assert kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 2
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert text == whole.content[1].text and events[-2].usage.output_tokens == whole.usage.output_tokens
    with sdk.messages.stream(model="tiny", max_tokens=100, messages=MSG) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["text"] and final.content[0].text == whole.content[1].text


def test_tool_round_trip(sdk, fake):
    fake.reply = CALL                                   # tool_choice any / tool bind the output: no thought
    for stream in (False, True):
        if stream:
            with sdk.messages.stream(model="tiny", max_tokens=100, messages=MSG, tools=[WEATHER],
                                     tool_choice={"type": "tool", "name": "get_weather"}) as s:
                m = s.get_final_message()
        else:
            m = sdk.messages.create(model="tiny", max_tokens=100, messages=MSG, tools=[WEATHER],
                                    tool_choice={"type": "any", "disable_parallel_tool_use": True})
        [use] = m.content
        assert (use.type, use.name, use.input, m.stop_reason) == ("tool_use", "get_weather", {"city": "Paris"}, "tool_use")
        assert use.id.startswith("toolu_")
    assert fake.calls[-2]["params"]["tool_choice"] == "required" and fake.calls[-2]["params"]["parallel_tool_calls"] is False
    fake.reply = "</think>Sunny."
    m2 = sdk.messages.create(model="tiny", max_tokens=100, tools=[WEATHER], messages=[
        *MSG, {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"},
                                     {"type": "text", "text": "so?"}]}])
    assert m2.content[0].text == "Sunny."
    assert fake.calls[-1]["messages"][1:] == [
        {"role": "assistant", "content": None, "tool_calls": [{"id": use.id, "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": use.id},
        {"role": "user", "content": "so?"}]


def test_auth_headers_and_error_shape(server, sdk):
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY},
                   json={"model": "tiny", "max_tokens": 5, "messages": MSG})
    assert r.status_code == 200 and r.json()["type"] == "message"
    with httpx.stream("POST", server.url + "/v1/messages", headers={"x-api-key": KEY},
                      json={"model": "tiny", "max_tokens": 50, "messages": MSG, "stream": True}) as r:
        names = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-1] == "message_stop"
    r = httpx.post(server.url + "/v1/messages", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "tiny", "max_tokens": 5, "messages": MSG})
    assert r.status_code == 200
    bad = anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="tiny", max_tokens=5, messages=MSG)
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error", "message": e.value.body["error"]["message"]}}
    with pytest.raises(anthropic.NotFoundError) as e:
        sdk.messages.create(model="other", max_tokens=5, messages=MSG)
    assert e.value.body["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("body, status, where", [
    ({"messages": MSG}, 400, "max_tokens"),                                        # required
    ({"max_tokens": "many", "messages": MSG}, 400, "max_tokens"),
    ({"max_tokens": 5, "messages": MSG, "bogus": 1}, 400, "bogus"),               # unknown field
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x", "x": 1}]}, 400, "messages.0.x"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400, "messages.0.role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "messages.0.content.0.type"),
    ({"max_tokens": 5, "messages": MSG, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "tools.0.type"),
    ({"max_tokens": 5, "messages": MSG, "stop_sequences": ["a"] * 9}, 400, "stop_sequences"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x" * 200_000}]}, 413, ""),
])
def test_bad_bodies_get_anthropic_errors(server, fake, body, status, where):
    n = len(fake.calls)
    r = httpx.post(server.url + "/v1/messages", json={"model": "tiny", **body}, headers={"x-api-key": KEY})
    assert r.status_code == status, r.text
    got = r.json()
    assert set(got) == {"type", "error"} and got["type"] == "error"
    assert got["error"]["type"] == ("invalid_request_error" if status == 400 else "request_too_large")
    assert where in got["error"]["message"]
    assert len(fake.calls) == n


def test_failure_after_start_is_an_error_event(sdk, fake):
    fake.fail_after = (3, UnavailableError("engine died"))
    with pytest.raises(anthropic.APIStatusError) as e:
        for _ in sdk.messages.create(model="tiny", max_tokens=100, messages=MSG, stream=True):
            pass
    assert "engine died" in str(e.value)


def test_an_unexpected_server_error_is_an_anthropic_500(server, fake):
    fake.fail_after = None
    real, fake.generate = fake.generate, None           # calling it raises TypeError inside the route
    try:
        r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY},
                       json={"model": "tiny", "max_tokens": 5, "messages": MSG})
    finally:
        fake.generate = real
    assert r.status_code == 500 and r.json() == {"type": "error", "error": {"type": "api_error",
                                                                           "message": "internal error"}}
