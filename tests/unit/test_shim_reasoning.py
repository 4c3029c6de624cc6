"""``--reasoning-parser deepseek_r1``: the parser's split is the same fed whole or in any pieces,
and chat completions carry the thinking in ``reasoning_content`` (streamed as its own deltas)."""
from __future__ import annotations

import random

import openai
import pytest

from client.fake_client import FakeLLMClient
from client.shim import ShimSettings, create_app
from client.shim.background import BackgroundServer
from client.shim.reasoning import ThinkParser, parses_reasoning, split_reasoning
from client.shim.schemas import ChatCompletionRequest
from client.shim.turn import Turn, TurnParser

TEXTS = ["<think>abc</think>answer", "abc</think>ans", "never closed", "  <think>x</thi", "</think>",
         "<thi", "a</think>b</think>c", "<think>", "", "思考 🐉</think>答案 <tool_call>\n{\"name\": \"f\", "
         "\"arguments\": {\"x\": 1}}\n</tool_call>"]


@pytest.mark.parametrize("text", TEXTS)
def test_split_is_the_same_in_any_pieces(text):
    rng = random.Random(text)
    whole = split_reasoning(text)
    whole_turn = Turn()
    whole_turn.take(TurnParser(reasoning=True, tools=True).feed(text, final=True))
    for _ in range(100):
        p, t, turn, r, a, i = ThinkParser(), TurnParser(reasoning=True, tools=True), Turn(), "", "", 0
        while i < len(text):
            j = i + rng.randint(1, 5)
            x, y = p.feed(text[i:j])
            r, a = r + x, a + y
            turn.take(t.feed(text[i:j], final=j >= len(text)))
            i = j
        x, y = p.finish()
        assert (r + x, a + y) == whole
        if not text:
            turn.take(t.feed("", final=True))
        assert (turn.reasoning, turn.text, [(c["name"], c["arguments"]) for c in turn.calls]) == \
            (whole_turn.reasoning, whole_turn.text, [(c["name"], c["arguments"]) for c in whole_turn.calls])


def test_split_values():
    assert split_reasoning("<think>abc</think>answer") == ("abc", "answer")
    assert split_reasoning("abc</think>ans") == ("abc", "ans")          # <think> was in the prompt
    assert split_reasoning("never closed") == ("never closed", "")      # deepseek_r1: all thinking
    assert split_reasoning("a</think>b</think>c") == ("a", "b</think>c")


@pytest.fixture(scope="module")
def fake():
    return FakeLLMClient(reply="Let me think: 你好 🐉.</think>The answer is 42.")


@pytest.fixture(scope="module")
def sdk(fake):
    settings = ShimSettings(model_name="tiny", reasoning_parser="deepseek_r1")
    with BackgroundServer(create_app(settings, client=fake)) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


MSG = [{"role": "user", "content": "hi"}]


def test_chat_reasoning_content_whole_and_streamed(sdk):
    r = sdk.chat.completions.create(model="tiny", messages=MSG)
    msg = r.choices[0].message
    assert (msg.reasoning_content, msg.content) == ("Let me think: 你好 🐉.", "The answer is 42.")
    chunks = list(sdk.chat.completions.create(model="tiny", messages=MSG, stream=True))
    thought = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (thought, text) == (msg.reasoning_content, msg.content)
    both = [c for c in chunks if c.choices and c.choices[0].delta.content
            and getattr(c.choices[0].delta, "reasoning_content", None)]
    assert both == []                                   # its own deltas, never mixed in one chunk


def test_include_reasoning_false_drops_the_thinking(sdk):
    r = sdk.chat.completions.create(model="tiny", messages=MSG, extra_body={"include_reasoning": False})
    msg = r.choices[0].message
    assert msg.content == "The answer is 42." and getattr(msg, "reasoning_content", None) is None
    chunks = list(sdk.chat.completions.create(model="tiny", messages=MSG, stream=True,
                                              extra_body={"include_reasoning": False}))
    assert not any(getattr(c.choices[0].delta, "reasoning_content", None) for c in chunks if c.choices)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "The answer is 42."


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("extra, parsed", [
    ({}, True),
    ({"tools": [TOOL]}, True),                                          # auto: the model may think first
    ({"guided_regex": "a+</think>b"}, True),
    ({"tools": [TOOL], "tool_choice": "required"}, False),              # bound from the first token
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}}, False),
    ({"response_format": {"type": "json_object"}}, False),
    ({"response_format": {"type": "text"}}, True),
    ({"guided_choice": ["a", "b"]}, False),
])
def test_grammar_bound_outputs_are_not_split(extra, parsed):
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], **extra)
    assert parses_reasoning("deepseek_r1", chat) is parsed
    assert parses_reasoning(None, chat) is False
