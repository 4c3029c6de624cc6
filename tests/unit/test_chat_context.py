"""Context-window policy: truncate keeps system + last N turns and fits; summarize calls the model
once per new stretch of history and caches the result."""
from __future__ import annotations

import asyncio

import pytest

from client.chat.context import (SUMMARY_HEADER, ContextBuilder, ContextTooLong, TokenCounter,
                                 reply_room)
from client.chat.store import ChatStore


@pytest.fixture(scope="module")
def counter():
    return TokenCounter()       # the project tokenizer (backend/assets/tokenizer)


@pytest.fixture
def store(tmp_path):
    s = ChatStore(str(tmp_path / "chat.sqlite3"))
    yield s
    s.close()


class FakeCompleter:
    def __init__(self):
        self.calls = []

    async def __call__(self, messages, *, max_tokens, tenant):
        self.calls.append((messages, max_tokens, tenant))
        return f"summary #{len(self.calls)}"


def grow(store, conv, turns, words=5, tenant="t"):
    """``turns`` answered user turns, then one pending user message; returns its id."""
    leaf = None
    for i in range(turns):
        u = store.add_message(tenant, conv, role="user", content=f"question {i} " + "word " * words,
                              parent_id=leaf)
        leaf = store.add_message(tenant, conv, role="assistant",
                                 content=f"answer {i} " + "reply " * words, parent_id=u.id).id
    return store.add_message(tenant, conv, role="user", content="last question",
                             parent_id=leaf).id


def build(builder, store, conv_id, leaf, tenant="t"):
    return asyncio.run(builder.build(tenant, store.get_conversation(tenant, conv_id), leaf))


def test_counter_matches_chat_template(counter):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo 你好 🙂"},
            {"role": "assistant", "content": "hi there"}, {"role": "user", "content": "again"}]
    assert counter.count(msgs) == counter.count_exact(msgs)
    assert counter.count([]) == counter.count_exact([]) == 3   # "<|im_start|>assistant\n"


def test_short_conversation_is_sent_whole(store, counter):
    conv = store.create_conversation("t", system_prompt="You are terse.", keep_turns=8).id
    leaf = grow(store, conv, 2)
    r = build(ContextBuilder(store, counter, max_model_len=1024), store, conv, leaf)
    assert r.messages[0] == {"role": "system", "content": "You are terse."}
    assert [m["role"] for m in r.messages] == ["system"] + ["user", "assistant"] * 2 + ["user"]
    assert (r.policy, r.applied, r.dropped_turns, r.kept_turns, r.summary) == \
        ("truncate", False, 0, 3, None)
    assert r.max_tokens == reply_room(1024, None) == 256
    assert r.prompt_tokens == counter.count_exact(r.messages)


def test_truncate_keeps_system_and_last_n_turns(store, counter):
    conv = store.create_conversation("t", system_prompt="SYS", keep_turns=3).id
    leaf = grow(store, conv, 6)
    r = build(ContextBuilder(store, counter, max_model_len=1024), store, conv, leaf)
    assert (r.applied, r.dropped_turns, r.kept_turns) == (True, 4, 3)
    assert [m["content"].split()[0:2] for m in r.messages[1:]] == [
        ["question", "4"], ["answer", "4"], ["question", "5"], ["answer", "5"], ["last", "question"]]
    assert r.messages[0] == {"role": "system", "content": "SYS"}


def test_truncate_drops_more_until_it_fits(store, counter):
    conv = store.create_conversation("t", system_prompt="SYS", keep_turns=50, max_tokens=100).id
    leaf = grow(store, conv, 12, words=40)
    builder = ContextBuilder(store, counter, max_model_len=400)
    r = build(builder, store, conv, leaf)
    assert r.max_tokens == 100
    assert r.prompt_tokens <= 400 - 100
    assert 0 < r.kept_turns < 13 and r.dropped_turns == 13 - r.kept_turns
    # Maximal: one more turn would not have fitted.
    path = store.path("t", conv, leaf)
    one_more = path[-(2 * r.kept_turns + 1):]
    extra = [{"role": "system", "content": "SYS"}] + [
        {"role": m.role, "content": m.content} for m in one_more]
    assert counter.count_exact(extra) > 300
    assert r.messages[0]["content"] == "SYS" and r.messages[-1]["content"] == "last question"


def test_turn_that_cannot_fit_is_rejected(store, counter):
    conv = store.create_conversation("t", max_tokens=100).id
    u = store.add_message("t", conv, role="user", content="word " * 400, parent_id=None)
    with pytest.raises(ContextTooLong) as err:
        build(ContextBuilder(store, counter, max_model_len=256), store, conv, u.id)
    assert err.value.param == "content" and "max_model_len 256" in str(err.value)


def test_context_needs_a_user_leaf(store, counter):
    conv = store.create_conversation("t").id
    leaf = grow(store, conv, 1)
    reply = store.add_message("t", conv, role="assistant", content="x", parent_id=leaf)
    with pytest.raises(ValueError):
        build(ContextBuilder(store, counter, max_model_len=1024), store, conv, reply.id)


def test_summarize_calls_the_model_once_and_caches(store, counter):
    conv = store.create_conversation("t", system_prompt="SYS", policy="summarize",
                                     keep_turns=2).id
    leaf = grow(store, conv, 5)
    complete = FakeCompleter()
    builder = ContextBuilder(store, counter, max_model_len=1024, complete=complete,
                             summary_tokens=64)
    r = build(builder, store, conv, leaf)
    assert len(complete.calls) == 1
    prompt, max_tokens, tenant = complete.calls[0]
    assert (max_tokens, tenant) == (64, "t")
    transcript = prompt[-1]["content"]
    for i in range(4):                                       # the four older turns, in order
        assert f"User: question {i}" in transcript and f"Assistant: answer {i}" in transcript
    assert "question 4" not in transcript
    assert (r.policy, r.applied, r.dropped_turns, r.summarized_turns, r.kept_turns, r.summary) == \
        ("summarize", True, 4, 4, 2, "summary #1")
    assert r.messages[0] == {"role": "system", "content": f"SYS\n\n{SUMMARY_HEADER}\nsummary #1"}
    assert [m["content"].split()[:2] for m in r.messages[1:]] == [
        ["question", "4"], ["answer", "4"], ["last", "question"]]
    # Asked again (another tab, a regenerate): served from the cache.
    again = build(builder, store, conv, leaf)
    assert len(complete.calls) == 1 and again.messages == r.messages
    # A fresh builder (server restart) still finds the summary in SQLite.
    fresh = ContextBuilder(store, counter, 1024, complete=complete, summary_tokens=64)
    assert build(fresh, store, conv, leaf).summary == "summary #1" and len(complete.calls) == 1


def test_summarize_extends_the_cached_summary(store, counter):
    conv = store.create_conversation("t", policy="summarize", keep_turns=2).id
    leaf = grow(store, conv, 4)
    complete = FakeCompleter()
    builder = ContextBuilder(store, counter, max_model_len=1024, complete=complete)
    assert build(builder, store, conv, leaf).summarized_turns == 3
    # Answer the pending question and ask another: one more turn slides out of the window.
    a = store.add_message("t", conv, role="assistant", content="answer 4", parent_id=leaf)
    leaf2 = store.add_message("t", conv, role="user", content="next", parent_id=a.id).id
    r = build(builder, store, conv, leaf2)
    assert (r.summarized_turns, r.summary, len(complete.calls)) == (4, "summary #2", 2)
    transcript = complete.calls[1][0][-1]["content"]
    assert transcript.startswith("Summary so far:\nsummary #1")
    assert "question 3" in transcript and "question 2" not in transcript   # only the new turn


def test_summarize_does_nothing_while_it_fits(store, counter):
    conv = store.create_conversation("t", policy="summarize", keep_turns=8).id
    leaf = grow(store, conv, 3)
    complete = FakeCompleter()
    r = build(ContextBuilder(store, counter, 1024, complete=complete), store, conv, leaf)
    assert (r.applied, r.summary, complete.calls) == (False, None, [])
