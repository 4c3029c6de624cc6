"""/v1/messages through the real stack (shim process + tritonserver, the ``tiny`` checkpoint),
driven by the official ``anthropic`` SDK: greedy text equals Chat Completions', the stream rebuilds
the message, a tool_use / tool_result round trip. Bad bodies get Anthropic-shaped 4xx errors and
leave the engine idle."""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests.e2e.shim_fixtures import KEY, MODEL, sdk, shim, wait_metric  # noqa: F401 -- fixtures

pytestmark = pytest.mark.e2e

PROMPT = "Tell me a story about 小猫 and 🐉."
GREEDY = {"extra_body": {"temperature": 0.0}}          # this SDK's create() has no sampling arguments
WEATHER = {"name": "get_weather", "description": "Current weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}


@pytest.fixture
def claude(shim):
    return anthropic.Anthropic(base_url=shim.url, api_key=KEY, max_retries=0, timeout=120)


def test_greedy_text_equals_chat_completions(claude, sdk):
    chat = sdk.chat.completions.create(model=MODEL, max_tokens=24, temperature=0.0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}])
    m = claude.messages.create(model=MODEL, max_tokens=24, system="Be brief.",
                               messages=[{"role": "user", "content": PROMPT}], **GREEDY)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    assert m.usage.output_tokens == chat.usage.completion_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert m.usage.cache_read_input_tokens > 0                           # the same prompt again


def test_stream_rebuilds_the_message(claude):
    msgs = [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]
    whole = claude.messages.create(model=MODEL, max_tokens=20, messages=msgs, **GREEDY)
    events = list(claude.messages.create(model=MODEL, max_tokens=20, messages=msgs, stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:-2] == ["content_block_start"] + ["content_block_delta"] * (len(kinds) - 5) + ["content_block_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    with claude.messages.stream(model=MODEL, max_tokens=20, messages=msgs, **GREEDY) as s:
        assert "".join(s.text_stream) == whole.content[0].text
        assert s.get_final_message().content[0].text == whole.content[0].text


def test_tool_use_round_trip(claude, sdk):
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    m = claude.messages.create(model=MODEL, max_tokens=200, messages=ask, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                               extra_body={"temperature": 1.0})
    [use] = m.content
    assert use.type == "tool_use" and use.name == "get_weather" and m.stop_reason == "tool_use"
    assert set(use.input) == {"city", "unit"} and use.input["unit"] in ("c", "f")
    with claude.messages.stream(model=MODEL, max_tokens=200, messages=ask, tools=[WEATHER],
                                tool_choice={"type": "any"}, extra_body={"temperature": 1.0}) as s:
        streamed = s.get_final_message()
    assert streamed.stop_reason == "tool_use" and all(b.type == "tool_use" for b in streamed.content)
    follow = [*ask, {"role": "assistant", "content": m.content},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": '{"temp_c": 21}'}]}]
    answer = claude.messages.create(model=MODEL, max_tokens=8, messages=follow, tools=[WEATHER], **GREEDY)
    chat = sdk.chat.completions.create(model=MODEL, max_tokens=8, temperature=0.0, tools=[{"type": "function", "function": {
        "name": WEATHER["name"], "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}}],
        messages=[*ask, {"role": "assistant", "content": None, "tool_calls": [{"id": use.id, "type": "function",
                  "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
                  {"role": "tool", "tool_call_id": use.id, "content": '{"temp_c": 21}'}])
    text = "".join(b.text for b in answer.content if b.type == "text")
    assert text == (chat.choices[0].message.content or "")
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == chat.usage.prompt_tokens


@pytest.mark.parametrize("headers, body, status, kind", [
    ({"x-api-key": "sk-wrong"}, {}, 401, "authentication_error"),
    ({}, {}, 401, "authentication_error"),
    ({"x-api-key": KEY}, {"max_tokens": "many"}, 400, "invalid_request_error"),
    ({"x-api-key": KEY}, {"unknown_field": True}, 400, "invalid_request_error"),
    ({"x-api-key": KEY}, {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error"),
    ({"x-api-key": KEY}, {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "invalid_request_error"),
    ({"Authorization": f"Bearer {KEY}"}, {"messages": [{"role": "user", "content": "x" * 300_000}]}, 400,
     "invalid_request_error"),
    ({"x-api-key": KEY}, {"model": "other"}, 404, "not_found_error"),
    ({"x-api-key": KEY}, {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, 400,
     "invalid_request_error"),
])
def test_bad_requests_get_anthropic_errors_and_the_engine_stays_idle(shim, headers, body, status, kind):
    payload = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **body}
    r = httpx.post(shim.url + "/v1/messages", json=payload, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    got = r.json()
    assert set(got) == {"type", "error"} and got["type"] == "error"
    assert got["error"]["type"] == kind and isinstance(got["error"]["message"], str) and got["error"]["message"]
    assert wait_metric(shim.metrics_url, "llm_kv_cache_usage_ratio", lambda v: v == 0, timeout=30) == 0
    assert wait_metric(shim.metrics_url, "llm_num_requests_running", lambda v: v == 0, timeout=30) == 0


def test_stream_disconnect_aborts_and_frees_kv(shim, sdk):
    from tests.e2e.test_shim_abort import assert_aborted_and_freed, idle

    ask = [{"role": "user", "content": "go on forever"}]
    long = sdk.chat.completions.create(model=MODEL, messages=ask, max_tokens=900, temperature=0.0)
    assert long.choices[0].finish_reason == "length"        # greedy: this prompt runs all 900 tokens
    before = idle(shim.metrics_url)
    body = {"model": MODEL, "max_tokens": 900, "messages": ask, "stream": True, "temperature": 0.0}
    with httpx.stream("POST", shim.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert any("text_delta" in next(lines) for _ in range(12))
        assert wait_metric(shim.metrics_url, "llm_kv_cache_usage_ratio", lambda v: v > 0, timeout=60) > 0
    assert_aborted_and_freed(shim.metrics_url, before)
