"""Structured outputs and tools on the real chat model (SmolLM2-135M-Instruct, ChatML without
native tool support: tools are rendered Hermes-style by backend/structured/tool_prompt.py)."""
from __future__ import annotations

import json

import openai
import pytest

from tests.e2e.shim_fixtures import KEY, start_shim, stop_shim

pytestmark = pytest.mark.e2e
pytest.importorskip("xgrammar")

MODEL = "tiny"          # the served name start_shim gives the model
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def sdk(real_server, tmp_path_factory):
    s = start_shim(real_server, tmp_path_factory.mktemp("shim-structured-real"))
    yield openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=600)
    stop_shim(s.proc)


@pytest.mark.parametrize("prompt", ["Return your name and age as JSON.", "List three fruits as a JSON object."])
def test_json_object_parses(sdk, prompt):
    r = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                    response_format={"type": "json_object"}, temperature=0.0, max_tokens=200)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_weather_tool_round_trip(sdk):
    """call -> tool result -> answer, through the chat completions API."""
    messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    first = sdk.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required",
                                        temperature=0.0, max_tokens=120)
    ch = first.choices[0]
    assert ch.finish_reason == "tool_calls", ch.message
    call = ch.message.tool_calls[0]
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert "paris" in args["city"].lower(), args
    messages += [ch.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18, "sky": "sunny"})}]
    second = sdk.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                         temperature=0.0, max_tokens=40)
    answer = second.choices[0].message.content
    assert answer and not second.choices[0].message.tool_calls
    assert "18" in answer                    # the tool result made it into the answer (greedy)
    print("answer:", answer)
