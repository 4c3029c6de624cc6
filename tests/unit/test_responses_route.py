"""/v1/responses against a scripted fake client, driven by the official ``openai`` SDK: the body
and stream shapes the SDK parses, tool calls, reasoning items, the stored conversation."""
from __future__ import annotations

import httpx
import openai
import pytest

from client.fake_client import REPLY, FakeLLMClient
from client.shim import ShimSettings, create_app
from client.shim.background import BackgroundServer

KEY = "sk-test-1"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def fake():
    return FakeLLMClient()


@pytest.fixture(scope="module")
def server(fake):
    settings = ShimSettings(model_name="tiny", api_keys={KEY: "acme", "sk-other": "globex"},
                            reasoning_parser="deepseek_r1")
    with BackgroundServer(create_app(settings, client=fake)) as srv:
        yield srv


@pytest.fixture
def sdk(server, fake):
    fake.reply, fake.fail_after = "plain answer</think>" + REPLY, None
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def test_plain_string_input_reasoning_and_message_items(sdk, fake):
    r = sdk.responses.create(model="tiny", input="hi", instructions="Be brief.", max_output_tokens=400,
                             temperature=0.0, top_p=0.5)
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "plain answer"
    assert r.output_text == REPLY
    assert r.usage.output_tokens == fake.tokens({})[0].__len__() and r.usage.total_tokens > r.usage.output_tokens
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    call = fake.calls[-1]
    assert call["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert call["params"] == {"max_tokens": 400, "temperature": 0.0, "top_p": 0.5, "tenant": "acme"}
    r = sdk.responses.create(model="tiny", input="hi", max_output_tokens=400, extra_body={"include_reasoning": False})
    assert [o.type for o in r.output] == ["message"] and r.output_text == REPLY


def test_stream_events_rebuild_the_same_response(sdk):
    whole = sdk.responses.create(model="tiny", input="hi", max_output_tokens=400)
    events = list(sdk.responses.create(model="tiny", input="hi", max_output_tokens=400, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert (thought, text) == ("plain answer", whole.output_text)
    for seq in (["response.output_item.added", "response.content_part.added", "response.output_text.delta"],
                ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                 "response.completed"]):
        at = kinds.index(seq[0], kinds.index("response.reasoning_text.done"))
        assert kinds[at:at + len(seq)] == seq
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    with sdk.responses.stream(model="tiny", input="hi", max_output_tokens=400) as s:
        got = s.get_final_response()
    assert got.output_text == whole.output_text


def test_function_call_round_trip_and_previous_response_id(sdk, fake):
    fake.reply = CALL                                   # a named tool_choice binds the output: no thought
    r = sdk.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER],
                             tool_choice={"type": "function", "name": "get_weather"})
    [call] = r.output
    assert call.type == "function_call" and call.status == "completed"
    assert (call.name, call.arguments, r.output_text) == ("get_weather", '{"city": "Paris"}', "")
    assert '"function": {"name": "get_weather"}' in fake.calls[-1]["params"]["tool_choice"]
    fake.reply = "</think>It is sunny."
    r2 = sdk.responses.create(model="tiny", previous_response_id=r.id, tools=[WEATHER],
                              input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert r2.output_text == "It is sunny." and r2.previous_response_id == r.id
    assert fake.calls[-1]["messages"] == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": call.call_id}]
    r3 = sdk.responses.create(model="tiny", previous_response_id=r2.id, input="Thanks", instructions="Short.")
    assert fake.calls[-1]["messages"][0] == {"role": "system", "content": "Short."}
    assert fake.calls[-1]["messages"][-2:] == [{"role": "assistant", "content": "It is sunny."},
                                               {"role": "user", "content": "Thanks"}]
    got = sdk.responses.retrieve(r2.id)                       # the stored body, as it was answered
    assert got.id == r2.id and got.output_text == r2.output_text and got.usage == r2.usage
    other = openai.OpenAI(base_url=str(sdk.base_url), api_key="sk-other", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(r2.id)
    with pytest.raises(openai.BadRequestError) as e:          # another tenant's id is not found
        other.responses.create(model="tiny", previous_response_id=r3.id, input="x")
    assert e.value.body["param"] == "previous_response_id"


def test_json_schema_goes_to_the_grammar(sdk, fake):
    fake.reply = '{"a": 1}'                              # bound by the grammar from the start: no thought
    r = sdk.responses.create(model="tiny", input="json", text={"format": {
        "type": "json_schema", "name": "thing", "schema": {"type": "object"}, "strict": True}})
    assert r.output_text == '{"a": 1}'
    assert fake.calls[-1]["params"]["response_format"] == (
        '{"type": "json_schema", "json_schema": {"name": "thing", "schema": {"type": "object"}, "strict": true}}')


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "x", "bogus": 1}, "bogus"),
    ({"input": 5}, "input"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0.type"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"input": "x" * 70000}, "input"),
])
def test_bad_bodies_are_400_naming_the_field(server, fake, body, param):
    n = len(fake.calls)
    r = httpx.post(server.url + "/v1/responses", json={"model": "tiny", **body},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    assert len(fake.calls) == n                                   # nothing reached the server


def test_failure_after_start_ends_the_stream_with_an_error_event(sdk, fake):
    from client.errors import UnavailableError
    fake.fail_after = (3, UnavailableError("engine died"))
    events = list(sdk.responses.create(model="tiny", input="hi", stream=True))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2].message == "engine died" and events[-1].response.status == "failed"
    assert "response.completed" not in {e.type for e in events}


def test_output_items_sent_back_as_input(sdk, fake):
    """The manual-state pattern: the previous output items (message, reasoning, function_call, with
    their ids and statuses) go back into ``input`` as they came."""
    fake.reply = "hmm</think>Call it." + CALL
    r = sdk.responses.create(model="tiny", input="Weather?", tools=[WEATHER], max_output_tokens=400)
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    items = [{"role": "user", "content": "Weather?"}, *[o.model_dump(exclude_none=True) for o in r.output],
             {"type": "function_call_output", "call_id": r.output[2].call_id, "output": "sunny"}]
    fake.reply = "</think>Sunny."
    r2 = sdk.responses.create(model="tiny", input=items, tools=[WEATHER])
    assert r2.output_text == "Sunny."
    assert fake.calls[-1]["messages"] == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Call it.", "tool_calls": [{"id": r.output[2].call_id, "type": "function",
                                                                      "function": {"name": "get_weather",
                                                                                   "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": r.output[2].call_id}]
