"""Session store on a real SQLite file: tree integrity, branches, cascades, tenant isolation."""
from __future__ import annotations

import sqlite3

import pytest

from client.chat.store import ChatStore, Invalid, NotFound


@pytest.fixture
def store(tmp_path):
    s = ChatStore(str(tmp_path / "chat.sqlite3"))
    yield s
    s.close()


def chat(store, tenant, conv, *pairs):
    """Append user/assistant pairs along the current leaf; returns the messages in order."""
    out = []
    for user, reply in pairs:
        leaf = store.get_conversation(tenant, conv).current_leaf_id
        u = store.add_message(tenant, conv, role="user", content=user, parent_id=leaf)
        a = store.add_message(tenant, conv, role="assistant", content=reply, parent_id=u.id)
        out += [u, a]
    return out


def test_conversation_crud_and_settings(store):
    c = store.create_conversation("t1", title="First", system_prompt="be brief", keep_turns=3)
    assert (c.title, c.system_prompt, c.policy, c.keep_turns, c.max_tokens, c.params) == \
        ("First", "be brief", "truncate", 3, None, {})
    assert c.current_leaf_id is None
    c2 = store.create_conversation("t1")
    assert c2.title == "New chat"
    assert [x.id for x in store.list_conversations("t1")] == [c2.id, c.id]   # newest first
    u = store.update_conversation("t1", c.id, title="  Renamed ", policy="summarize",
                                  max_tokens=64, params={"temperature": 0.5, "ignore_eos": True})
    assert (u.title, u.policy, u.max_tokens, u.params) == \
        ("Renamed", "summarize", 64, {"temperature": 0.5, "ignore_eos": True})
    assert [x.id for x in store.list_conversations("t1")] == [c.id, c2.id]   # touched: first
    store.delete_conversation("t1", c2.id)
    assert [x.id for x in store.list_conversations("t1")] == [c.id]
    with pytest.raises(NotFound):
        store.get_conversation("t1", c2.id)


@pytest.mark.parametrize("fields,param", [
    ({"policy": "forget"}, "policy"), ({"keep_turns": 0}, "keep_turns"),
    ({"keep_turns": True}, "keep_turns"), ({"title": "  "}, "title"),
    ({"max_tokens": -1}, "max_tokens"), ({"params": {"api_key": "x"}}, "params"),
    ({"params": {"temperature": "hot"}}, "params"), ({"params": {"ignore_eos": 1}}, "params"),
])
def test_settings_are_validated(store, fields, param):
    with pytest.raises(Invalid) as err:
        store.create_conversation("t", **fields)
    assert err.value.param == param


def test_tree_paths_siblings_and_leaf(store):
    c = store.create_conversation("t").id
    u1, a1, u2, a2 = chat(store, "t", c, ("hi", "hello"), ("2+2?", "4"))
    assert store.get_conversation("t", c).current_leaf_id == a2.id
    assert [m.id for m in store.path("t", c)] == [u1.id, a1.id, u2.id, a2.id]
    # Edit u2: a sibling under a1, the new current branch.
    u2b = store.add_message("t", c, role="user", content="3+3?", parent_id=a1.id)
    a2b = store.add_message("t", c, role="assistant", content="6", parent_id=u2b.id)
    assert [m.content for m in store.path("t", c)] == ["hi", "hello", "3+3?", "6"]
    assert store.get_message("t", c, a1.id).children == [u2.id, u2b.id]
    # Regenerate a2b: a sibling reply.
    a2c = store.add_message("t", c, role="assistant", content="six", parent_id=u2b.id)
    assert store.get_message("t", c, u2b.id).children == [a2b.id, a2c.id]
    # Switching to the old branch descends to its newest leaf.
    assert store.set_leaf("t", c, u2.id) == a2.id
    assert [m.content for m in store.path("t", c)] == ["hi", "hello", "2+2?", "4"]
    assert store.set_leaf("t", c, u2b.id) == a2c.id
    assert store.set_leaf("t", c, u2b.id, descend=False) == u2b.id
    assert [m.id for m in store.path("t", c, a2b.id)] == [u1.id, a1.id, u2b.id, a2b.id]
    # Editing the first message makes a second root.
    r2 = store.add_message("t", c, role="user", content="hey", parent_id=None)
    msgs = store.messages("t", c)
    assert [m.id for m in msgs.values() if m.parent_id is None] == [u1.id, r2.id]
    assert list(msgs) == [u1.id, a1.id, u2.id, a2.id, u2b.id, a2b.id, a2c.id, r2.id]
    assert msgs[a1.id].children == [u2.id, u2b.id]
    assert [m.id for m in store.path("t", c)] == [r2.id]


def test_roles_alternate_and_stats_round_trip(store):
    c = store.create_conversation("t").id
    with pytest.raises(Invalid):
        store.add_message("t", c, role="assistant", content="x", parent_id=None)
    u = store.add_message("t", c, role="user", content="q", parent_id=None)
    with pytest.raises(Invalid):
        store.add_message("t", c, role="user", content="again", parent_id=u.id)
    with pytest.raises(Invalid):
        store.add_message("t", c, role="system", content="x", parent_id=None)
    with pytest.raises(Invalid):
        store.add_message("t", c, role="user", content="  ", parent_id=None)
    stats = {"completion_tokens": 7, "cached_tokens": 3, "ttft_ms": 12.5, "tokens_per_s": 40.0}
    a = store.add_message("t", c, role="assistant", content="par", parent_id=u.id,
                          finish_reason="abort", stopped=True, stats=stats,
                          context={"policy": "truncate", "dropped_turns": 0})
    got = store.get_message("t", c, a.id)
    assert (got.stopped, got.finish_reason, got.stats, got.context["policy"]) == \
        (True, "abort", stats, "truncate")


def test_parent_must_be_in_same_conversation(store, tmp_path):
    c1 = store.create_conversation("t").id
    c2 = store.create_conversation("t").id
    u1 = store.add_message("t", c1, role="user", content="q", parent_id=None)
    with pytest.raises(NotFound):
        store.add_message("t", c2, role="assistant", content="x", parent_id=u1.id)
    with pytest.raises(NotFound):
        store.set_leaf("t", c2, u1.id)
    # The database itself refuses a cross-conversation parent (composite foreign key).
    db = sqlite3.connect(store.db_path)
    db.execute("PRAGMA foreign_keys = ON")
    with pytest.raises(sqlite3.IntegrityError):
        db.execute("INSERT INTO messages (id, conversation_id, parent_id, seq, role, content,"
                   " created_at) VALUES ('m_x', ?, ?, 99, 'assistant', 'x', 0)", (c2, u1.id))
    db.close()


def test_delete_cascades_to_messages_and_summaries(store):
    keep = store.create_conversation("t").id
    gone = store.create_conversation("t").id
    chat(store, "t", keep, ("a", "b"))
    msgs = chat(store, "t", gone, ("a", "b"), ("c", "d"))
    store.put_summary("t", gone, msgs[1].id, "summary", 1)
    store.delete_conversation("t", gone)
    db = sqlite3.connect(store.db_path)
    assert db.execute("SELECT COUNT(*) FROM messages WHERE conversation_id = ?", (gone,)).fetchone() \
        == (0,)
    assert db.execute("SELECT COUNT(*) FROM summaries").fetchone() == (0,)
    assert db.execute("SELECT COUNT(*) FROM messages WHERE conversation_id = ?", (keep,)).fetchone() \
        == (2,)
    db.close()
    with pytest.raises(NotFound):
        store.delete_conversation("t", gone)


def test_tenant_isolation(store):
    mine = store.create_conversation("alice", title="secret")
    u = chat(store, "alice", mine.id, ("q", "a"))[0]
    assert store.list_conversations("bob") == []
    for call in (lambda: store.get_conversation("bob", mine.id),
                 lambda: store.update_conversation("bob", mine.id, title="pwned"),
                 lambda: store.delete_conversation("bob", mine.id),
                 lambda: store.messages("bob", mine.id),
                 lambda: store.path("bob", mine.id),
                 lambda: store.get_message("bob", mine.id, u.id),
                 lambda: store.set_leaf("bob", mine.id, u.id),
                 lambda: store.add_message("bob", mine.id, role="assistant", content="x",
                                           parent_id=u.id),
                 lambda: store.summaries("bob", mine.id),
                 lambda: store.put_summary("bob", mine.id, u.id, "x", 1)):
        with pytest.raises(NotFound):
            call()
    # Bob's own conversation cannot adopt Alice's message as a parent either.
    theirs = store.create_conversation("bob").id
    with pytest.raises(NotFound):
        store.add_message("bob", theirs, role="assistant", content="x", parent_id=u.id)
    assert store.get_conversation("alice", mine.id).title == "secret"
    assert len(store.messages("alice", mine.id)) == 2


def test_persists_across_reopen(tmp_path):
    path = str(tmp_path / "chat.sqlite3")
    s = ChatStore(path)
    c = s.create_conversation("t", title="kept").id
    chat(s, "t", c, ("q", "a"))
    s.close()
    s = ChatStore(path)
    assert [m.content for m in s.path("t", c)] == ["q", "a"]
    s.close()
