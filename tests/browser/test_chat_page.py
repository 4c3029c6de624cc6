"""The chat page in headless Chromium against the real stack (tritonserver + shim).

One scenario, in the order a user would go: API key, two conversations with streamed replies,
a reply stopped mid-stream (checked on the engine's abort counter), an edit that branches, the old
branch still there, rename, delete; then a screenshot for a human to look at.
"""
from __future__ import annotations

import time

import pytest
from playwright.sync_api import Page, expect

pytestmark = [pytest.mark.browser, pytest.mark.e2e]

# A guard, not a bound: on a loaded CI host a server's first step may also build the C step library.
REPLY_MS = 300_000
DONE = """n => !document.querySelector('[data-testid=msg-streaming]')
          && document.querySelectorAll('[data-testid=msg-assistant]').length === n"""


# The distinct lengths the streaming message's text takes, recorded as the DOM changes.
WATCH_SIZES = """() => { window.__sizes = new Set(); new MutationObserver(() => {
    const e = document.querySelector('[data-testid=msg-streaming] [data-testid=content]');
    if (e && e.textContent.length > 0) window.__sizes.add(e.textContent.length);
}).observe(document.body, {subtree: true, childList: true, characterData: true}); }"""


def set_reply_options(page: Page, max_tokens: int, ignore_eos: bool = False,
                      keep_turns: int | None = None) -> None:
    page.get_by_test_id("settings-toggle").click()
    page.get_by_test_id("set-max-tokens").fill(str(max_tokens))
    page.get_by_test_id("set-ignore-eos").set_checked(ignore_eos)
    if keep_turns is not None:
        page.get_by_test_id("set-keep").fill(str(keep_turns))
    page.get_by_test_id("settings-save").click()
    expect(page.locator("#settings-status")).to_have_text("Saved.")
    page.locator("#settings-cancel").click()


def send(page: Page, text: str, replies_after: int) -> str:
    """Send ``text`` and wait for the streamed reply to be stored; returns the reply's text."""
    page.get_by_test_id("input").fill(text)
    page.get_by_test_id("input").press("Enter")
    page.wait_for_function(DONE, arg=replies_after, timeout=REPLY_MS)
    last = page.get_by_test_id("msg-assistant").last
    return last.get_by_test_id("content").inner_text()


def conversation_items(page: Page):
    return page.get_by_test_id("conv-item")


def test_chat_page_scenario(chat_stack, chat_page, output_dir):
    page = chat_page
    page.goto(chat_stack.base_url + "/")
    # The server has keys: without one the page says so; with one it loads.
    expect(page.get_by_test_id("error")).to_contain_text("API key")
    page.get_by_test_id("api-key").fill(chat_stack.keys["carol"])
    page.get_by_test_id("api-key").press("Tab")
    expect(page.locator("#model-info")).to_contain_text("context 1,024 tokens")
    expect(page.get_by_test_id("error")).to_be_hidden()

    # Conversation A: two streamed turns with short replies.
    page.get_by_test_id("new-chat").click()
    set_reply_options(page, max_tokens=24)
    first_reply = send(page, "Hello! Please introduce yourself.", 1)
    assert first_reply.strip()
    stats = page.get_by_test_id("msg-assistant").last.get_by_test_id("stats").inner_text()
    assert "tokens" in stats and "prompt cached" in stats and "TTFT" in stats and "tok/s" in stats
    second_reply = send(page, "What can you do for me today?", 2)
    # Regenerate the second reply: a sibling reply, and the first one is still one click away.
    page.get_by_test_id("msg-assistant").last.get_by_test_id("regenerate").click()
    page.wait_for_function(DONE, arg=2, timeout=REPLY_MS)
    regenerated = page.get_by_test_id("msg-assistant").last
    expect(regenerated.get_by_test_id("branch-pos")).to_have_text("2/2")
    regenerated.get_by_test_id("branch-prev").click()
    expect(page.get_by_test_id("msg-assistant").last.get_by_test_id("branch-pos")).to_have_text("1/2")
    assert page.get_by_test_id("msg-assistant").last.get_by_test_id("content").inner_text() \
        == second_reply
    expect(page.get_by_test_id("conv-title")).to_have_text("Hello! Please introduce yourself.")

    # Conversation B: a long reply (ignore_eos), stopped while it streams.
    page.get_by_test_id("new-chat").click()
    expect(conversation_items(page)).to_have_count(2)
    set_reply_options(page, max_tokens=900, ignore_eos=True)
    aborts_before = chat_stack.abort_count()
    page.evaluate(WATCH_SIZES)
    page.get_by_test_id("input").fill("Count slowly to one thousand.")
    page.get_by_test_id("send").click()
    # Three sizes of the streaming text, seen by an observer as the DOM changes (a poll could miss
    # sizes of a reply that streams fast); then stop it while it streams (900 tokens, ignore_eos).
    page.wait_for_function("window.__sizes.size >= 3", timeout=REPLY_MS)
    page.get_by_test_id("stop").click()
    page.wait_for_function(DONE, arg=1)
    stopped = page.get_by_test_id("msg-assistant").last
    expect(stopped.get_by_test_id("stopped")).to_be_visible()
    partial = stopped.get_by_test_id("content").inner_text()
    assert partial.strip(), "the partial reply was not kept"
    deadline = time.monotonic() + 60                      # counted at the metrics poll: generous
    while chat_stack.abort_count() < aborts_before + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert chat_stack.abort_count() >= aborts_before + 1, "the engine did not count an abort"
    # The stopped reply is stored as stopped, with its partial text.
    page.reload()
    stopped = page.get_by_test_id("msg-assistant").last
    expect(stopped.get_by_test_id("stopped")).to_be_visible()
    assert stopped.get_by_test_id("content").inner_text() == partial
    expect(page.get_by_test_id("send")).to_be_enabled()

    # Back to A: edit the first message -> a second branch with its own reply.
    conversation_items(page).filter(has_text="Hello! Please").click()
    page.wait_for_function(DONE, arg=2)
    page.get_by_test_id("msg-user").first.get_by_test_id("edit").click()
    page.get_by_test_id("edit-input").fill("Hi! Who are you, really?")
    page.get_by_test_id("edit-save").click()
    page.wait_for_function(DONE, arg=1, timeout=REPLY_MS)
    first_user = page.get_by_test_id("msg-user").first
    expect(first_user.get_by_test_id("branch-pos")).to_have_text("2/2")
    expect(first_user.get_by_test_id("content")).to_have_text("Hi! Who are you, really?")
    # Switch back: the original branch, with its original reply and second turn.
    first_user.get_by_test_id("branch-prev").click()
    page.wait_for_function(DONE, arg=2)
    expect(page.get_by_test_id("msg-user").first.get_by_test_id("branch-pos")).to_have_text("1/2")
    expect(page.get_by_test_id("msg-user").first.get_by_test_id("content")) \
        .to_have_text("Hello! Please introduce yourself.")
    assert page.get_by_test_id("msg-assistant").first.get_by_test_id("content").inner_text() \
        == first_reply
    # ...and forward again.
    page.get_by_test_id("msg-user").first.get_by_test_id("branch-next").click()
    page.wait_for_function(DONE, arg=1)

    # Rename A, delete B.
    page.get_by_test_id("rename").click()
    page.get_by_test_id("title-input").fill("Introductions")
    page.get_by_test_id("title-input").press("Enter")
    expect(page.get_by_test_id("conv-title")).to_have_text("Introductions")
    expect(conversation_items(page).first).to_contain_text("Introductions")
    victim = conversation_items(page).filter(has_text="Count slowly")
    victim.hover()
    victim.get_by_test_id("delete-conv").click()
    victim.get_by_test_id("delete-conv").click()           # second click confirms
    expect(conversation_items(page)).to_have_count(1)
    page.reload()
    expect(conversation_items(page)).to_have_count(1)
    expect(page.get_by_test_id("conv-title")).to_have_text("Introductions")

    # Another key sees none of it.
    page.get_by_test_id("api-key").fill(chat_stack.keys["dave"])
    page.get_by_test_id("api-key").press("Tab")
    expect(conversation_items(page)).to_have_count(0)
    page.get_by_test_id("api-key").fill(chat_stack.keys["carol"])
    page.get_by_test_id("api-key").press("Tab")
    expect(conversation_items(page)).to_have_count(1)

    # Back on the original branch, keep only the last turn: the page says older turns were left out.
    page.get_by_test_id("msg-user").first.get_by_test_id("branch-prev").click()
    page.wait_for_function(DONE, arg=2)
    set_reply_options(page, max_tokens=24, keep_turns=1)
    send(page, "And one more thing?", 3)
    notice = page.get_by_test_id("msg-assistant").last.get_by_test_id("context-notice")
    expect(notice).to_contain_text("2 older turns left out (truncate policy, the last 1 turn kept)")
    page.get_by_test_id("input").fill("A message I am still writing…")
    page.screenshot(path=str(output_dir / "chat.png"))
