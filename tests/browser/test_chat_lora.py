"""The chat page's model picker in headless Chromium against tritonserver serving a LoRA adapter:
the picker lists the base model and the adapter (GET /v1/models), a reply asked on the adapter
carries it as the request's ``model`` and is the adapter's answer (the same body sent with the
OpenAI SDK), and a reply regenerated on the base model is another answer, in its own branch."""
from __future__ import annotations

import json

import openai
import pytest
from playwright.sync_api import Page, expect

from tests.browser.conftest import _need_tritonserver, _shim_stack, _work_dir
from tests.conftest import model_dir
from tests.unit.lora_helpers import make_adapter

pytestmark = [pytest.mark.browser, pytest.mark.e2e]

MAX_TOKENS = 16
REPLY_DONE = """() => !document.querySelector('[data-testid=msg-streaming]')
                && !document.querySelector('[data-testid=preparing]')"""


@pytest.fixture(scope="module")
def lora_stack(tmp_path_factory):
    from backend.serving.launcher import TritonServer

    _need_tritonserver()
    tiny = model_dir("tiny")
    adapter = make_adapter(tiny, tmp_path_factory.mktemp("lora") / "poet", 16, 32,
                           ["q_proj", "v_proj", "down_proj"], 61)
    opts = {"num_kv_blocks": "64", "block_size": "16", "num_threads": "1", "max_loras": "1",
            "max_lora_rank": "16", "lora_modules": json.dumps({"poet": str(adapter)})}
    work, keys_file = _work_dir("chat-lora-")
    with TritonServer(tiny, engine_options=opts, quiet=True) as server:
        yield from _shim_stack(server, server.model_dir, work, keys_file, ("--lora-name", "poet"))


def completions_requests(page: Page) -> list[dict]:
    """The bodies the page posts to /v1/chat/completions, as they are sent."""
    bodies: list[dict] = []
    page.on("request", lambda r: bodies.append(r.post_data_json)
            if r.url.endswith("/v1/chat/completions") and r.method == "POST" else None)
    return bodies


def sdk_answer(stack, body: dict) -> str:
    """The same request through the OpenAI SDK, not streamed."""
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.keys["dave"], max_retries=0, timeout=120)
    extra = {k: v for k, v in body.items() if k not in ("model", "messages", "stream", "stream_options",
                                                           "max_tokens", "temperature")}
    r = client.chat.completions.create(model=body["model"], messages=body["messages"], max_tokens=body["max_tokens"],
                                       temperature=body["temperature"], extra_body=extra)
    return r.choices[0].message.content


def test_the_page_asks_the_picked_adapter(lora_stack, chat_page, output_dir):
    page = chat_page
    sent = completions_requests(page)
    page.goto(lora_stack.base_url + "/")
    page.get_by_test_id("api-key").fill(lora_stack.keys["dave"])
    page.get_by_test_id("api-key").press("Tab")
    picker = page.get_by_test_id("model-select")
    expect(picker.locator("option")).to_have_text(["tiny", "poet (adapter of tiny)"])
    expect(picker).to_have_value("tiny")                    # the base model until one is picked

    page.get_by_test_id("new-chat").click()
    page.get_by_test_id("settings-toggle").click()          # greedy, fixed length: comparable answers
    page.get_by_test_id("set-max-tokens").fill(str(MAX_TOKENS))
    page.locator("#set-temperature").fill("0")
    page.get_by_test_id("set-ignore-eos").set_checked(True)
    page.get_by_test_id("settings-save").click()
    expect(page.locator("#settings-status")).to_have_text("Saved.")
    page.locator("#settings-cancel").click()

    picker.select_option("poet")
    page.get_by_test_id("input").fill("Write a line about the sea.")
    page.get_by_test_id("input").press("Enter")
    reply = page.get_by_test_id("msg-assistant").last
    expect(reply.get_by_test_id("reply-model")).to_have_text("poet")    # stored with the reply
    page.wait_for_function(REPLY_DONE)
    assert len(sent) == 1 and sent[0]["model"] == "poet" and sent[0]["temperature"] == 0
    on_adapter = reply.get_by_test_id("content").text_content()
    assert on_adapter and on_adapter == sdk_answer(lora_stack, sent[0])

    # The same question regenerated on the base model: a second branch, another answer.
    picker.select_option("tiny")
    reply.get_by_test_id("regenerate").click()
    expect(page.get_by_test_id("branch-pos").last).to_have_text("2/2")
    page.wait_for_function(REPLY_DONE)
    assert len(sent) == 2 and sent[1]["model"] == "tiny" and sent[1]["messages"] == sent[0]["messages"]
    reply = page.get_by_test_id("msg-assistant").last
    expect(reply.get_by_test_id("reply-model")).to_have_count(0)         # base replies carry no tag
    on_base = reply.get_by_test_id("content").text_content()
    assert on_base == sdk_answer(lora_stack, sent[1]) and on_base != on_adapter
    page.screenshot(path=str(output_dir / "chat-lora-picker.png"))

    # The pick is remembered across a reload.
    picker.select_option("poet")
    page.reload()
    expect(page.get_by_test_id("model-select")).to_have_value("poet")
