"""SQLite session store: conversations (per tenant) holding a tree of messages.

    conversation ── current_leaf ──┐
        │                          ▼
        └─ messages:  u1 ─ a1 ─ u2 ─ a2        a message's parent is in the same conversation
                       │         └─ u2' ─ a2'  (an edit: a sibling of u2, a new branch)
                       └─ u1' ...              (roots are siblings too)

Every method takes the tenant and only ever touches that tenant's rows: another tenant's
conversation is indistinguishable from a missing one (:class:`NotFound`, HTTP 404).
Foreign keys are ON; deleting a conversation cascades to its messages and cached summaries.
The composite key (conversation_id, parent_id) -> messages(conversation_id, id) makes "the parent
lives in the same conversation" a database invariant, not only an application check.
Per-tenant quotas (conversations, bytes) are quota.py's; the database file (and its WAL / shm
files) is created with mode 0600: conversations are private to the server's user.
"""
from __future__ import annotations

import json
import os
import secrets
import sqlite3
import threading
import time

from client.chat import quota as quotas
from client.chat.records import SCHEMA, Conversation, Message
from client.chat.quota import QuotaExceeded, TenantQuota  # noqa: F401 (re-exported)
from client.chat.validation import (ALLOWED_PARAMS, POLICIES, Invalid, NotFound,  # noqa: F401 (re-exported)
                                    validate_message, validate_settings)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


class ChatStore:
    """All conversation state. Thread-safe: one connection, one lock (requests are short)."""

    def __init__(self, path: str, quota: TenantQuota | None = None):
        self.db_path = path
        self.quota = quota or TenantQuota()
        self._lock = threading.RLock()
        if path != ":memory:":
            _create_private(path)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA foreign_keys = ON")
        self._db.execute("PRAGMA busy_timeout = 5000")     # another process (a second shim) writing
        if path != ":memory:":
            # WAL: readers never block the writer, and a crash loses at most the last transaction
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = NORMAL")
        self._db.executescript(SCHEMA)
        quotas.ensure_column(self._db)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- conversations ---------------------------------------------------------------------------
    def create_conversation(self, tenant: str, **settings) -> Conversation:
        fields = validate_settings(settings)
        now = time.time()
        conv_id = _new_id("conv")
        with self._lock:
            quotas.check_new_conversation(self._db, tenant, self.quota)
            self._db.execute(
                "INSERT INTO conversations (id, tenant, title, created_at, updated_at, system_prompt,"
                " policy, keep_turns, max_tokens, params) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (conv_id, tenant, fields.get("title", "New chat"), now, now,
                 fields.get("system_prompt", ""), fields.get("policy", "truncate"),
                 fields.get("keep_turns", 8), fields.get("max_tokens"),
                 json.dumps(fields.get("params", {}))))
        return self.get_conversation(tenant, conv_id)

    def list_conversations(self, tenant: str) -> list[Conversation]:
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM conversations WHERE tenant = ? ORDER BY updated_at DESC, id",
                (tenant,)).fetchall()
        return [self._conv(r) for r in rows]

    def get_conversation(self, tenant: str, conv_id: str) -> Conversation:
        with self._lock:
            row = self._db.execute("SELECT * FROM conversations WHERE id = ? AND tenant = ?",
                                   (conv_id, tenant)).fetchone()
        if row is None:
            raise NotFound(f"conversation {conv_id!r} not found")
        return self._conv(row)

    def update_conversation(self, tenant: str, conv_id: str, **settings) -> Conversation:
        fields = validate_settings(settings)
        if "params" in fields:
            fields["params"] = json.dumps(fields["params"])
        with self._lock:
            self.get_conversation(tenant, conv_id)
            if fields:
                cols = ", ".join(f"{k} = ?" for k in fields)
                self._db.execute(f"UPDATE conversations SET {cols}, updated_at = ? "
                                 "WHERE id = ? AND tenant = ?",
                                 (*fields.values(), time.time(), conv_id, tenant))
        return self.get_conversation(tenant, conv_id)

    def delete_conversation(self, tenant: str, conv_id: str) -> None:
        with self._lock:
            cur = self._db.execute("DELETE FROM conversations WHERE id = ? AND tenant = ?",
                                   (conv_id, tenant))
        if cur.rowcount == 0:
            raise NotFound(f"conversation {conv_id!r} not found")

    # -- messages --------------------------------------------------------------------------------
    def add_message(self, tenant: str, conv_id: str, *, role: str, content: str,
                    parent_id: str | None, finish_reason: str | None = None, stopped: bool = False,
                    stats: dict | None = None, context: dict | None = None) -> Message:
        """Append a message under ``parent_id`` (None: a new root) and make it the current leaf.

        Roles alternate along a path: a user message follows an assistant message (or is a root),
        an assistant message follows a user message.
        """
        if role not in ("user", "assistant"):
            raise Invalid("role must be 'user' or 'assistant'", "role")
        validate_message(content, stats, context)
        if role == "user" and not content.strip():
            raise Invalid("content must not be empty", "content")
        if finish_reason is not None and (not isinstance(finish_reason, str) or len(finish_reason) > 32):
            raise Invalid("finish_reason is a short string", "finish_reason")
        with self._lock:
            self.get_conversation(tenant, conv_id)
            if parent_id is None:
                if role != "user":
                    raise Invalid("a conversation starts with a user message", "role")
            else:
                parent = self._message_row(conv_id, parent_id)
                if parent["role"] == role:
                    raise Invalid(f"a {role} message cannot follow a {parent['role']} message",
                                  "parent_id")
            size = quotas.message_bytes(content, stats, context)
            quotas.check_new_bytes(self._db, tenant, self.quota, size)
            now = time.time()
            msg_id = _new_id("msg")
            seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM messages "
                                   "WHERE conversation_id = ?", (conv_id,)).fetchone()[0]
            self._db.execute("BEGIN")
            try:
                self._db.execute(
                    "INSERT INTO messages (id, conversation_id, parent_id, seq, role, content,"
                    " created_at, finish_reason, stopped, stats, context)"
                    " VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                    (msg_id, conv_id, parent_id, seq, role, content, now, finish_reason,
                     int(bool(stopped)), json.dumps(stats) if stats is not None else None,
                     json.dumps(context) if context is not None else None))
                self._db.execute("UPDATE conversations SET current_leaf_id = ?, updated_at = ?, "
                                 "bytes = bytes + ? WHERE id = ?", (msg_id, now, size, conv_id))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return self.get_message(tenant, conv_id, msg_id)

    def retract_message(self, tenant: str, conv_id: str, msg_id: str, leaf_id: str | None) -> None:
        """Undo ``add_message`` of a message that was refused after it was stored (its context did
        not fit): delete it (it has no children yet) and make ``leaf_id`` the leaf again."""
        with self._lock:
            self.get_conversation(tenant, conv_id)
            row = self._db.execute("SELECT length(CAST(content AS BLOB)) + COALESCE(length(stats), 0)"
                                   " + COALESCE(length(context), 0) FROM messages WHERE id = ? AND "
                                   "conversation_id = ?", (msg_id, conv_id)).fetchone()
            self._db.execute("BEGIN")
            try:
                cur = self._db.execute("DELETE FROM messages WHERE id = ? AND conversation_id = ? AND NOT "
                                 "EXISTS (SELECT 1 FROM messages c WHERE c.conversation_id = ? AND "
                                 "c.parent_id = ?)", (msg_id, conv_id, conv_id, msg_id))
                freed = row[0] if row is not None and cur.rowcount else 0
                self._db.execute("UPDATE conversations SET current_leaf_id = ?, bytes = MAX(0, bytes - ?) "
                                 "WHERE id = ? AND tenant = ?", (leaf_id, freed, conv_id, tenant))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def get_message(self, tenant: str, conv_id: str, msg_id: str) -> Message:
        with self._lock:
            self.get_conversation(tenant, conv_id)
            msg = self._msg(self._message_row(conv_id, msg_id))
            msg.children = [r[0] for r in self._db.execute(
                "SELECT id FROM messages WHERE conversation_id = ? AND parent_id = ? ORDER BY seq",
                (conv_id, msg_id))]
        return msg

    def messages(self, tenant: str, conv_id: str) -> dict[str, Message]:
        """Every message of the conversation by id (creation order), with children filled in."""
        with self._lock:
            self.get_conversation(tenant, conv_id)
            rows = self._db.execute("SELECT * FROM messages WHERE conversation_id = ? ORDER BY seq",
                                    (conv_id,)).fetchall()
        out = {r["id"]: self._msg(r) for r in rows}
        for m in out.values():
            if m.parent_id is not None:
                out[m.parent_id].children.append(m.id)
        return out

    def path(self, tenant: str, conv_id: str, leaf_id: str | None = None) -> list[Message]:
        """Messages from the root to ``leaf_id`` (default: the current leaf), in order."""
        conv = self.get_conversation(tenant, conv_id)
        leaf_id = leaf_id if leaf_id is not None else conv.current_leaf_id
        if leaf_id is None:
            return []
        with self._lock:
            self._message_row(conv_id, leaf_id)
            rows = self._db.execute(
                "WITH RECURSIVE up(id, parent_id, depth) AS ("
                " SELECT id, parent_id, 0 FROM messages WHERE id = ? AND conversation_id = ?"
                " UNION ALL SELECT m.id, m.parent_id, up.depth + 1 FROM messages m"
                " JOIN up ON m.id = up.parent_id AND m.conversation_id = ?)"
                " SELECT messages.* FROM up JOIN messages ON messages.id = up.id"
                " ORDER BY up.depth DESC", (leaf_id, conv_id, conv_id)).fetchall()
        return [self._msg(r) for r in rows]

    def set_leaf(self, tenant: str, conv_id: str, msg_id: str, *, descend: bool = True) -> str:
        """Make ``msg_id`` (or, with ``descend``, the newest leaf below it) the current leaf."""
        with self._lock:
            self.get_conversation(tenant, conv_id)
            self._message_row(conv_id, msg_id)
            leaf = msg_id
            while descend:
                row = self._db.execute("SELECT id FROM messages WHERE conversation_id = ? AND "
                                       "parent_id = ? ORDER BY seq DESC LIMIT 1",
                                       (conv_id, leaf)).fetchone()
                if row is None:
                    break
                leaf = row[0]
            self._db.execute("UPDATE conversations SET current_leaf_id = ?, updated_at = ? "
                             "WHERE id = ? AND tenant = ?", (leaf, time.time(), conv_id, tenant))
        return leaf

    # -- summaries (cache for the summarize policy) ----------------------------------------------
    def summaries(self, tenant: str, conv_id: str) -> dict[str, tuple[str, int]]:
        """Every cached summary of the conversation: upto_id -> (content, turns), one query."""
        with self._lock:
            self.get_conversation(tenant, conv_id)
            rows = self._db.execute("SELECT upto_id, content, turns FROM summaries WHERE "
                                    "conversation_id = ?", (conv_id,)).fetchall()
        return {r[0]: (r[1], r[2]) for r in rows}

    def usage(self, tenant: str) -> tuple[int, int]:
        """(conversations, bytes) the tenant holds against its quota."""
        with self._lock:
            return quotas.usage(self._db, tenant)

    def put_summary(self, tenant: str, conv_id: str, upto_id: str, content: str, turns: int) -> None:
        with self._lock:
            self.get_conversation(tenant, conv_id)
            self._message_row(conv_id, upto_id)
            self._db.execute("INSERT OR REPLACE INTO summaries VALUES (?,?,?,?,?)",
                             (conv_id, upto_id, turns, content, time.time()))

    # -- rows ------------------------------------------------------------------------------------
    def _message_row(self, conv_id: str, msg_id: str) -> sqlite3.Row:
        row = self._db.execute("SELECT * FROM messages WHERE id = ? AND conversation_id = ?",
                               (msg_id, conv_id)).fetchone()
        if row is None:
            raise NotFound(f"message {msg_id!r} not found in conversation {conv_id!r}")
        return row

    @staticmethod
    def _conv(r: sqlite3.Row) -> Conversation:
        return Conversation(id=r["id"], title=r["title"], created_at=r["created_at"],
                            updated_at=r["updated_at"], current_leaf_id=r["current_leaf_id"],
                            system_prompt=r["system_prompt"], policy=r["policy"],
                            keep_turns=r["keep_turns"], max_tokens=r["max_tokens"],
                            params=json.loads(r["params"]))

    @staticmethod
    def _msg(r: sqlite3.Row) -> Message:
        return Message(id=r["id"], conversation_id=r["conversation_id"], parent_id=r["parent_id"],
                       role=r["role"], content=r["content"], created_at=r["created_at"],
                       finish_reason=r["finish_reason"], stopped=bool(r["stopped"]),
                       stats=json.loads(r["stats"]) if r["stats"] else None,
                       context=json.loads(r["context"]) if r["context"] else None)


def _create_private(path: str) -> None:
    """Create the database file readable by its owner only (an existing one is narrowed to 0600);
    SQLite gives its -wal and -shm files the database file's mode."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
