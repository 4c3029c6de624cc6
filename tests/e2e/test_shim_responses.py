"""/v1/responses through the real stack (shim process + tritonserver, the ``tiny`` checkpoint),
driven by the official ``openai`` SDK: greedy text equals Chat Completions', streamed events
rebuild the body, json_schema through the grammar, a function-tool round trip, and a
``previous_response_id`` continuation served from the prefix cache. Bad bodies are OpenAI-shaped
400s and leave the engine idle."""
from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.shim_fixtures import KEY, MODEL, sdk, shim, wait_metric  # noqa: F401 -- fixtures

pytestmark = pytest.mark.e2e

PROMPT = "Tell me a story about 小猫 and 🐉."
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                           "unit": {"type": "string", "enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)


def chat_answer(sdk, messages, **kw):
    return sdk.chat.completions.create(model=MODEL, messages=messages, temperature=0.0, **kw)


def test_greedy_text_equals_chat_completions(sdk):
    chat = chat_answer(sdk, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}],
                       max_tokens=24)
    r = sdk.responses.create(model=MODEL, input=PROMPT, instructions="Be brief.", max_output_tokens=24,
                             temperature=0.0, top_p=1.0)
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert [o.type for o in r.output] == ["message"]
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.input_tokens_details.cached_tokens > 0                # the same prompt again
    as_list = sdk.responses.create(model=MODEL, max_output_tokens=24, temperature=0.0, input=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": PROMPT}]}])
    assert as_list.output_text == r.output_text


def test_streamed_events_rebuild_the_response(sdk):
    whole = sdk.responses.create(model=MODEL, input=PROMPT, max_output_tokens=20, temperature=0.0)
    events = list(sdk.responses.create(model=MODEL, input=PROMPT, max_output_tokens=20, temperature=0.0,
                                       stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == ("response.incomplete" if whole.status == "incomplete" else "response.completed")
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert final.output[0].id == events[2].item.id                      # the streamed item is the body's
    kept = sdk.responses.retrieve(final.id)                              # a streamed response is stored too
    assert kept.output_text == whole.output_text and kept.output[0].id == final.output[0].id


def test_json_schema_through_the_grammar(sdk):
    for seed in range(2):
        r = sdk.responses.parse(model=MODEL, input="A pet as JSON.", text_format=Pet, max_output_tokens=200,
                                temperature=1.0, extra_body={"seed": seed})
        assert r.status == "completed" and isinstance(r.output_parsed, Pet), r.output_text
    events = list(sdk.responses.create(model=MODEL, input="A pet as JSON.", max_output_tokens=200, stream=True,
                                       temperature=1.0, extra_body={"seed": 5}, text={"format": {
                                           "type": "json_schema", "name": "pet", "strict": True,
                                           "schema": Pet.model_json_schema()}}))
    Pet.model_validate_json("".join(e.delta for e in events if e.type == "response.output_text.delta"))


def test_function_tool_round_trip_and_continuation_reuse_the_prefix(sdk):
    first = sdk.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER], max_output_tokens=200,
                                 tool_choice={"type": "function", "name": "get_weather"}, temperature=1.0,
                                 extra_body={"seed": 3})
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    args = json.loads(calls[0].arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
    second = sdk.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER],
                                  max_output_tokens=8, temperature=0.0, input=[
                                      {"type": "function_call_output", "call_id": c.call_id, "output": '{"temp_c": 21}'}
                                      for c in calls])
    assert second.status in ("completed", "incomplete") and second.previous_response_id == first.id
    # its prompt = the first prompt + the calls + their outputs: longer, and the first's blocks cached
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens // 2
    assert second.usage.input_tokens_details.cached_tokens >= (first.usage.input_tokens // 16) * 16 > 0
    # the same conversation sent in full gets the same greedy answer
    full = sdk.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=8, temperature=0.0, input=[
        {"role": "user", "content": "Weather in Paris?"},
        *[{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments} for c in calls],
        *[{"type": "function_call_output", "call_id": c.call_id, "output": '{"temp_c": 21}'} for c in calls]])
    assert full.output_text == second.output_text and full.usage.input_tokens == second.usage.input_tokens


def test_previous_response_id_continues_the_conversation(sdk):
    r1 = sdk.responses.create(model=MODEL, input=PROMPT, max_output_tokens=16, temperature=0.0)
    r2 = sdk.responses.create(model=MODEL, previous_response_id=r1.id, input="And then?", max_output_tokens=8,
                              temperature=0.0)
    chat = chat_answer(sdk, [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": r1.output_text},
                             {"role": "user", "content": "And then?"}], max_tokens=8)
    assert r2.output_text == chat.choices[0].message.content
    assert r2.usage.input_tokens == chat.usage.prompt_tokens
    assert r2.usage.input_tokens_details.cached_tokens >= (r1.usage.input_tokens // 16) * 16 > 0
    not_kept = sdk.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.BadRequestError) as e:
        sdk.responses.create(model=MODEL, previous_response_id=not_kept.id, input="x")
    assert e.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "tools": [{"type": "web_search_preview"}]}, "tools.0.type"),
    ({"input": "x", "unknown_field": 1}, "unknown_field"),
    ({"input": {"role": "user"}}, "input"),
    ({"input": "x", "max_output_tokens": "eight"}, "max_output_tokens"),
    ({"input": "x", "temperature": float("nan")}, None),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input.0.content.0.type"),
    ({"input": "x" * 300_000}, "input"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}}, "text.format"),
])
def test_bad_bodies_are_openai_400s_and_the_engine_stays_idle(shim, body, param):
    raw = json.dumps({"model": MODEL, **body}, allow_nan=True)
    r = httpx.post(shim.url + "/v1/responses", content=raw, timeout=60,
                   headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    assert wait_metric(shim.metrics_url, "llm_kv_cache_usage_ratio", lambda v: v == 0, timeout=30) == 0
    assert wait_metric(shim.metrics_url, "llm_num_requests_running", lambda v: v == 0, timeout=30) == 0


def test_stream_disconnect_aborts_and_frees_kv(shim):
    from tests.e2e.test_shim_abort import assert_aborted_and_freed, idle

    before = idle(shim.metrics_url)
    body = {"model": MODEL, "input": "go on forever", "stream": True, "max_output_tokens": 900, "ignore_eos": True}
    with httpx.stream("POST", shim.url + "/v1/responses", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert any("response.output_text.delta" in next(lines) for _ in range(30))
        assert wait_metric(shim.metrics_url, "llm_kv_cache_usage_ratio", lambda v: v > 0, timeout=60) > 0
    assert_aborted_and_freed(shim.metrics_url, before)       # the connection was closed above
