"""Per-tenant storage quotas of the chat store: how many conversations a tenant keeps, and how many
bytes of messages (content plus their stats / context notes, UTF-8).

Each conversation row carries the bytes of its messages (``conversations.bytes``), kept up to date
in the same transaction as every message insert or removal, so a tenant's usage is one indexed
aggregate over its conversations, never a scan of their messages; deleting a conversation gives
its bytes back. A request past a quota is refused before anything is written: HTTP 429 with
OpenAI's ``insufficient_quota`` error (router.py), and the tenant frees room by deleting
conversations. Databases made before the column existed get it, filled in, when opened.
"""
from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass

DEFAULT_MAX_CONVERSATIONS = 500
DEFAULT_MAX_BYTES = 32 * 1024 * 1024


class QuotaExceeded(Exception):
    """A tenant at its quota (HTTP 429, ``insufficient_quota``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class TenantQuota:
    max_conversations: int = DEFAULT_MAX_CONVERSATIONS
    max_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        if self.max_conversations < 1 or self.max_bytes < 1:
            raise ValueError("chat quotas must be at least 1")


def message_bytes(content: str, stats: dict | None, context: dict | None) -> int:
    return (len(content.encode("utf-8", "surrogatepass"))
            + sum(len(json.dumps(v)) for v in (stats, context) if v is not None))


def ensure_column(db: sqlite3.Connection) -> None:
    cols = {r[1] for r in db.execute("PRAGMA table_info(conversations)")}
    if "bytes" in cols:
        return
    db.execute("ALTER TABLE conversations ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0")
    db.execute("UPDATE conversations SET bytes = (SELECT COALESCE(SUM(length(CAST(content AS BLOB))"
               " + COALESCE(length(stats), 0) + COALESCE(length(context), 0)), 0)"
               " FROM messages WHERE conversation_id = conversations.id)")


def usage(db: sqlite3.Connection, tenant: str) -> tuple[int, int]:
    """(conversations, bytes) the tenant holds."""
    n, size = db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM conversations WHERE tenant = ?",
                         (tenant,)).fetchone()
    return int(n), int(size)


def check_new_conversation(db: sqlite3.Connection, tenant: str, quota: TenantQuota) -> None:
    n, _ = usage(db, tenant)
    if n >= quota.max_conversations:
        raise QuotaExceeded(f"this tenant keeps {n} conversations, its quota is "
                            f"{quota.max_conversations}; delete some to make new ones")


def check_new_bytes(db: sqlite3.Connection, tenant: str, quota: TenantQuota, add: int) -> None:
    _, size = usage(db, tenant)
    if size + add > quota.max_bytes:
        raise QuotaExceeded(f"this message ({add} bytes) would take this tenant's chat storage to "
                            f"{size + add} bytes, over its quota of {quota.max_bytes}; delete "
                            "conversations to make room", "content")
