"""Tool calls: the Hermes <tool_call> parser (streamed in any chunking == parsed whole), the shim's
ToolTally response shapes, and tools rendered into a ChatML template without tool support."""
from __future__ import annotations

import json

import pytest

from backend.structured.tool_prompt import template_inputs
from client.shim.tools import ToolCallParser, ToolTally, parse_tool_calls
from client.wire import Chunk

CASES = [
    ("Hello there.", "Hello there.", []),
    (' <tool_call>\n{"name": "f", "arguments": {"a": "x}\\"", "b": [1, {"c": 2}]}}\n</tool_call>\n'
     '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
     "", [("f", '{"a": "x}\\"", "b": [1, {"c": 2}]}'), ("g", "{}")]),
    ('Let me check. <tool_call>{"arguments": {"q": 1}, "name": "h"}</tool_call>', "Let me check.", [("h", '{"q": 1}')]),
    ("x <tool_call>not json</tool_call>", "x<tool_call>not json</tool_call>", []),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1', "", [("f", '{"a": 1')]),      # cut off (length)
    ("a <tool_ca", "a <tool_ca", []),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("f", '{"a": 1}')]),
]


def _stream(text: str, step: int) -> tuple[str, list[tuple[str, str]]]:
    p, content, calls = ToolCallParser(), "", {}

    def take(c, deltas):
        nonlocal content
        content += c
        for d in deltas:
            call = calls.setdefault(d["index"], ["", ""])
            if "id" in d:
                assert d["type"] == "function" and d["id"].startswith("call_")
                call[0] += d["function"]["name"]
            call[1] += d["function"]["arguments"]

    for i in range(0, len(text), step):
        take(*p.feed(text[i:i + step]))
    take(*p.finish())
    return content, [tuple(v) for _, v in sorted(calls.items())]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_parse_whole_and_streamed_in_any_chunking(text, content, calls):
    got_content, got_calls = parse_tool_calls(text)
    assert (got_content, [(c["name"], c["arguments"]) for c in got_calls]) == (content, calls)
    for step in (1, 2, 3, 5, 11, len(text)):
        assert _stream(text, step) == (content, calls), step


def test_tool_tally_streams_openai_tool_call_chunks():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
    whole = ToolTally(chat=True, request_id="r", model="m", num_choices=1, logprobs=False)
    for k, piece in enumerate(pieces):
        whole.add(0, 0, Chunk(text=piece, finish_reason="stop" if k == len(pieces) - 1 else None))
    msg = whole.response()["choices"][0]
    assert msg["finish_reason"] == "tool_calls" and msg["message"]["content"] is None
    call = msg["message"]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}

    stream = ToolTally(chat=True, request_id="r", model="m", num_choices=1, logprobs=False)
    events = []
    for k, piece in enumerate(pieces):
        events += stream.chunk_events(0, 0, Chunk(text=piece, finish_reason="stop" if k == len(pieces) - 1 else None))
    bodies = [json.loads(e[len("data: "):]) for e in events]
    args, names, finish = "", "", None
    for b in bodies:
        ch = b["choices"][0]
        assert not ch["delta"].get("content")
        for d in ch["delta"].get("tool_calls", []):
            names += d["function"].get("name", "")
            args += d["function"]["arguments"]
        finish = ch["finish_reason"] or finish
    assert (names, args, finish) == ("get_weather", '{"city": "Paris"}', "tool_calls")
    assert sum(1 for b in bodies if b["choices"][0]["finish_reason"]) == 1


class _ChatML:
    chat_template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}"


def test_tools_rendered_for_a_template_without_tool_support():
    tools = [{"name": "get_weather", "description": "weather", "parameters": {"type": "object"}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    out, extra = template_inputs(_ChatML(), messages, tools)
    assert extra == {} and out[0]["role"] == "system" and '"get_weather"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content":
                      '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert out[3]["role"] == "tool" and json.loads(out[3]["content"].split("\n")[1]) == {
        "name": "get_weather", "content": "18 C"}
    plain, extra = template_inputs(_ChatML(), [{"role": "user", "content": "hi", "name": "x"}], None)
    assert plain == [{"role": "user", "content": "hi"}] and extra == {}

    class Native:
        chat_template = "{% if tools %}...{% endif %}"
    same, extra = template_inputs(Native(), messages, tools)
    assert same is messages and extra["tools"][0]["function"]["name"] == "get_weather"
