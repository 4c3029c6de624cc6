"""The chat page on the default model (SmolLM2-135M-Instruct) in headless Chromium: real words.

The server's context window is the model's 8,192 tokens clamped to its 512-token KV pool
(tests/conftest.py REAL_ENGINE_OPTIONS), so a long conversation reaches it within a few turns and
the page's context policy has to count with the model's own tokenizer: a miscount would send a
prompt the server rejects.
"""
from __future__ import annotations

import pytest
from playwright.sync_api import Page, expect

from tests.browser.test_chat_page import DONE, REPLY_MS, send, set_reply_options
from tests.conftest import REAL_CONTEXT_WINDOW

pytestmark = [pytest.mark.browser, pytest.mark.e2e]

TOPICS = ["the history of the printing press and how it changed the way people shared ideas",
          "how bees tell the rest of the hive where the flowers are",
          "why the sky looks blue during the day and red at sunset",
          "the rules of chess and what makes an opening strong or weak",
          "how a bicycle stays upright while it moves and why it falls when it stops",
          "how vaccines teach the immune system to recognise a virus",
          "why the moon shows phases and what an eclipse is"]


# Counts DOM changes that leave text in the streaming message, as they happen: a poll for that
# state could miss a reply that streams and is stored between two polls (a fast or loaded host).
WATCH_STREAMING = """() => { window.__streamedText = 0; new MutationObserver(() => {
    const e = document.querySelector('[data-testid=msg-streaming] [data-testid=content]');
    if (e && e.textContent.length > 0) window.__streamedText += 1;
}).observe(document.body, {subtree: true, childList: true, characterData: true}); }"""


def open_chat(page: Page, stack, key: str) -> None:
    page.goto(stack.base_url + "/")
    page.get_by_test_id("api-key").fill(stack.keys[key])
    page.get_by_test_id("api-key").press("Tab")
    expect(page.locator("#model-info")).to_contain_text(f"context {REAL_CONTEXT_WINDOW:,} tokens")
    page.get_by_test_id("new-chat").click()


def test_the_chat_page_answers_in_english(real_chat_stack, chat_page, output_dir):
    page = chat_page
    open_chat(page, real_chat_stack, "alice")
    set_reply_options(page, max_tokens=32)
    page.evaluate(WATCH_STREAMING)
    page.get_by_test_id("input").fill("What is the capital of France?")
    page.get_by_test_id("input").press("Enter")
    page.wait_for_function(DONE, arg=1, timeout=REPLY_MS)
    assert page.evaluate("window.__streamedText") > 0      # the reply streamed in before it was stored
    answer = page.get_by_test_id("msg-assistant").last.get_by_test_id("content").inner_text()
    assert "Paris" in answer, answer
    expect(page.get_by_test_id("error")).to_be_hidden()
    page.screenshot(path=str(output_dir / "real-model-chat.png"))


def test_a_long_conversation_keeps_to_the_context_window(real_chat_stack, chat_page, output_dir):
    page = chat_page
    open_chat(page, real_chat_stack, "bob")
    set_reply_options(page, max_tokens=24, keep_turns=100)     # only the window limits the prompt
    notices = []
    for i, topic in enumerate(TOPICS):
        reply = send(page, f"Question {i + 1}. Please explain {topic}. Use simple words, give one "
                           "concrete example, and say what is still not well understood about it.",
                     i + 1)
        assert reply.strip(), f"turn {i + 1}: empty reply"
        expect(page.get_by_test_id("error")).to_be_hidden()
        notice = page.get_by_test_id("msg-assistant").last.get_by_test_id("context-notice")
        notices.append(notice.inner_text() if notice.count() else "")
    # The first turns fit whole; later ones leave older turns out, and the conversation goes on.
    assert notices[0] == "" and notices[1] == "", notices
    assert "left out (truncate policy" in notices[-1], notices
    dropped_late = [n for n in notices if "left out" in n]
    assert len(dropped_late) >= 2, notices
    page.screenshot(path=str(output_dir / "real-model-long-chat.png"), full_page=True)
    # What the page kept still answers: the last reply is stored and the input is usable.
    expect(page.get_by_test_id("send")).to_be_enabled()
    page.wait_for_function(DONE, arg=len(TOPICS))
