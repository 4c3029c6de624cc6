"""``--reasoning-parser deepseek_r1`` on the real stack: a ``tiny`` variant whose chat template opens
``<think>`` in the prompt (as DeepSeek-R1's does; same seeded weights), its own tritonserver and
shim. A grammar (``guided_regex``) makes the random-weight model close its thought, so the split
is exact and checkable; without it the model never writes ``</think>`` and all of its output is
reasoning."""
from __future__ import annotations

import json
import re
import shutil

import openai
import pytest

from tests.conftest import E2E_ENGINE_OPTIONS, model_dir
from tests.e2e.shim_fixtures import KEY, MODEL, start_shim, stop_shim

pytestmark = pytest.mark.e2e

THINK_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                  "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
                  "{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}")
SHAPE = r"[a-z]{2,8}( [a-z]{2,8}){1,3}</think>[a-z]{2,8}( [a-z]{2,8}){1,2}\."
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from backend.serving.launcher import TritonServer

    tmp = tmp_path_factory.mktemp("reasoning")
    ckpt = tmp / "tiny-think"
    shutil.copytree(model_dir("tiny"), ckpt)
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    cfg["chat_template"] = THINK_TEMPLATE
    (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
    with TritonServer(ckpt, engine_options=E2E_ENGINE_OPTIONS, quiet=True, workdir=tmp / "triton") as server:
        shim = start_shim(server, tmp, extra_args=("--reasoning-parser", "deepseek_r1"))
        try:
            yield shim
        finally:
            stop_shim(shim.proc)


@pytest.fixture
def sdk(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def raw_text(sdk, max_tokens: int, **extra) -> str:
    """The model's own output for the chat prompt the template renders (completions: no parsing)."""
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    return sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                  extra_body=extra).choices[0].text


def test_chat_splits_reasoning_content_whole_and_streamed(sdk):
    r = sdk.chat.completions.create(model=MODEL, messages=HI, max_tokens=80, temperature=0.0,
                                    extra_body={"guided_regex": SHAPE})
    msg = r.choices[0].message
    raw = raw_text(sdk, 80, guided_regex=SHAPE)
    assert re.fullmatch(SHAPE, raw) and r.choices[0].finish_reason == "stop"
    assert (msg.reasoning_content, msg.content) == tuple(raw.split("</think>"))
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=HI, max_tokens=80, temperature=0.0, stream=True,
                                              extra_body={"guided_regex": SHAPE}))
    thought = [c.choices[0].delta.reasoning_content for c in chunks
               if c.choices and getattr(c.choices[0].delta, "reasoning_content", None)]
    answer = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(thought) > 1 and ("".join(thought), "".join(answer)) == (msg.reasoning_content, msg.content)


def test_unclosed_thought_is_all_reasoning_and_include_reasoning_false_drops_it(sdk):
    raw = raw_text(sdk, 12)
    assert "</think>" not in raw
    r = sdk.chat.completions.create(model=MODEL, messages=HI, max_tokens=12, temperature=0.0)
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == (raw, "")
    off = sdk.chat.completions.create(model=MODEL, messages=HI, max_tokens=80, temperature=0.0,
                                      extra_body={"guided_regex": SHAPE, "include_reasoning": False})
    assert off.choices[0].message.content == raw_text(sdk, 80, guided_regex=SHAPE).split("</think>")[1]
    assert getattr(off.choices[0].message, "reasoning_content", None) is None


def test_responses_reasoning_item_then_message(sdk):
    raw = raw_text(sdk, 80, guided_regex=SHAPE)
    thought, answer = raw.split("</think>")
    r = sdk.responses.create(model=MODEL, input="hi", max_output_tokens=80, temperature=0.0,
                             extra_body={"guided_regex": SHAPE})
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert (r.output[0].content[0].text, r.output_text) == (thought, answer)
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    events = list(sdk.responses.create(model=MODEL, input="hi", max_output_tokens=80, temperature=0.0, stream=True,
                                       extra_body={"guided_regex": SHAPE}))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer
    assert [e.item.type for e in events if e.type == "response.output_item.done"] == ["reasoning", "message"]
