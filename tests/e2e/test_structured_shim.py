"""Structured outputs and tool calls through the OpenAI shim and a real tritonserver (the ``tiny``
preset: random weights, so every valid JSON is the grammar's doing), driven by the official SDK."""
from __future__ import annotations

import asyncio
import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.shim_fixtures import MODEL, async_sdk, sdk, shim  # noqa: F401 -- fixtures

pytestmark = pytest.mark.e2e
pytest.importorskip("xgrammar")

CHAT = [{"role": "user", "content": "Describe a person as JSON."}]


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)


class Person(BaseModel):
    name: str = Field(max_length=10)
    adult: bool
    pets: list[Pet] = Field(max_length=2)
    score: float = Field(ge=0, le=10)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                     "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 6}},
                                       "required": ["tz"], "additionalProperties": False}}}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": Person.model_json_schema(),
                                                        "strict": True}}


def test_sdk_parse_returns_a_parsed_object(sdk):
    for seed in range(3):
        r = sdk.chat.completions.parse(model=MODEL, messages=CHAT, response_format=Person, max_tokens=300,
                                       temperature=1.0, seed=seed)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop" and isinstance(msg.parsed, Person), msg.content


def test_json_schema_streamed_at_16_with_unconstrained_neighbours_unchanged(async_sdk):
    free = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=24,
                temperature=0.0)

    async def text(stream_it: bool, **kw) -> tuple[str, str]:
        if not stream_it:
            r = await async_sdk.chat.completions.create(**kw)
            return r.choices[0].message.content, r.choices[0].finish_reason
        parts, finish = [], None
        async for chunk in await async_sdk.chat.completions.create(stream=True, **kw):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish

    async def run():
        alone = await text(False, **free)
        jobs = [text(i % 2 == 0, model=MODEL, messages=CHAT, max_tokens=300, temperature=1.0, seed=i,
                     response_format=SCHEMA_FORMAT) for i in range(16)]
        jobs += [text(i % 2 == 1, **free) for i in range(4)]
        return alone, await asyncio.gather(*jobs)

    alone, results = asyncio.run(run())
    for body, finish in results[:16]:
        assert finish == "stop", body
        Person.model_validate_json(body, strict=True)
    assert all(r == alone for r in results[16:])


def test_max_tokens_inside_a_value_is_length(sdk):
    r = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=1.0, seed=0,
                                    response_format=SCHEMA_FORMAT)
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(openai.LengthFinishReasonError):
        sdk.chat.completions.parse(model=MODEL, messages=CHAT, max_tokens=5, response_format=Person)


def test_guided_extras_and_json_object(sdk):
    r = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=1.0, seed=1,
                                    extra_body={"guided_choice": ["red", "green", "blue"]})
    assert r.choices[0].message.content in ("red", "green", "blue")
    r = sdk.completions.create(model=MODEL, prompt="Code:", max_tokens=20, temperature=1.0, seed=1,
                               extra_body={"guided_regex": r"[A-Z]{3}-\d{4}"})
    t = r.choices[0].text
    assert len(t) == 8 and t[:3].isupper() and t[3] == "-" and t[4:].isdigit(), t
    r = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0.0,
                                    response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":             # random weights may not close it in 40
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def _weather_args(call) -> dict:
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f") and len(args["city"]) <= 12
    return args


def test_tool_choice_required_and_named(sdk):
    for seed in range(3):
        r = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                        tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
                                        max_tokens=200, temperature=1.0, seed=seed)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
        call = ch.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        if call.function.name == "get_weather":
            _weather_args(call)
        else:
            assert set(json.loads(call.function.arguments)) == {"tz"}
    r = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                    tools=[WEATHER, TIME], max_tokens=200, temperature=1.0, seed=9,
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    _weather_args(r.choices[0].message.tool_calls[0])


def test_streamed_tool_call_deltas_reassemble_to_the_non_streamed_result(sdk):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo and the time?"}],
              tools=[WEATHER, TIME], tool_choice="required", max_tokens=300, temperature=1.0, seed=4)
    whole = sdk.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    chunks = 0
    for chunk in sdk.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        for tc in d.tool_calls or []:
            chunks += 1
            c = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
            if tc.id:
                c["id"] = tc.id
            if tc.function and tc.function.name:
                c["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                c["arguments"] += tc.function.arguments
    assert finish == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert chunks > len(calls)                           # arguments arrived in pieces
    for c in calls.values():
        json.loads(c["arguments"])


def test_tool_result_goes_back_into_the_next_turn(sdk):
    first = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}],
                                        tools=[WEATHER], tool_choice="required", max_tokens=200, seed=2,
                                        temperature=1.0)
    call = first.choices[0].message.tool_calls[0]
    messages = [{"role": "user", "content": "Weather in Rome?"},
                first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'}]
    second = sdk.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=8,
                                         temperature=0.0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens       # the call and its result were rendered


def test_logit_bias(sdk):
    from transformers import PreTrainedTokenizerFast
    from tests.conftest import model_dir

    tok = PreTrainedTokenizerFast.from_pretrained(str(model_dir("tiny")))
    tid = tok.encode(" the")[0]
    r = sdk.completions.create(model=MODEL, prompt="Once", max_tokens=4, temperature=0.0,
                               logit_bias={str(tid): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == tok.decode([tid] * 4)


@pytest.mark.parametrize("kw,param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
      "properties": {"a": {"$ref": "#/$defs/missing"}}}}}), "response_format"),
    (dict(extra_body={"guided_regex": "(unclosed"}), "guided_regex"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(logit_bias={"5": 500}), "logit_bias"),
    (dict(logit_bias={"99999999": 1}), "logit_bias"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"}), "guided_regex"),
])
def test_clear_400s(sdk, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, **kw)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param, e.value.body
