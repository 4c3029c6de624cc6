"""The chat store's records and their tables: a conversation (its settings, current leaf and the
bytes its messages hold) and a message (a node of the conversation's tree, with its children's
ids); cached summaries. ``conversations.bytes`` is added to older databases by quota.py."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id              TEXT PRIMARY KEY,
    tenant          TEXT NOT NULL,
    title           TEXT NOT NULL,
    created_at      REAL NOT NULL,
    updated_at      REAL NOT NULL,
    current_leaf_id TEXT REFERENCES messages(id) ON DELETE SET NULL,
    system_prompt   TEXT NOT NULL DEFAULT '',
    policy          TEXT NOT NULL DEFAULT 'truncate' CHECK (policy IN ('truncate', 'summarize')),
    keep_turns      INTEGER NOT NULL DEFAULT 8 CHECK (keep_turns >= 1),
    max_tokens      INTEGER CHECK (max_tokens IS NULL OR max_tokens >= 1),
    params          TEXT NOT NULL DEFAULT '{}',
    bytes           INTEGER NOT NULL DEFAULT 0       -- its messages' bytes (quota.py)
);
CREATE INDEX IF NOT EXISTS conversations_tenant ON conversations(tenant, updated_at);
CREATE TABLE IF NOT EXISTS messages (
    id              TEXT PRIMARY KEY,
    conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    parent_id       TEXT,
    seq             INTEGER NOT NULL,
    role            TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
    content         TEXT NOT NULL,
    created_at      REAL NOT NULL,
    finish_reason   TEXT,
    stopped         INTEGER NOT NULL DEFAULT 0,
    stats           TEXT,
    context         TEXT,
    UNIQUE (conversation_id, id),
    FOREIGN KEY (conversation_id, parent_id) REFERENCES messages(conversation_id, id)
        ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS messages_parent ON messages(conversation_id, parent_id, seq);
CREATE TABLE IF NOT EXISTS summaries (
    conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    upto_id         TEXT NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
    turns           INTEGER NOT NULL,
    content         TEXT NOT NULL,
    created_at      REAL NOT NULL,
    PRIMARY KEY (conversation_id, upto_id)
);
"""


@dataclass
class Conversation:
    id: str
    title: str
    created_at: float
    updated_at: float
    current_leaf_id: str | None
    system_prompt: str
    policy: str
    keep_turns: int
    max_tokens: int | None
    params: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Message:
    id: str
    conversation_id: str
    parent_id: str | None
    role: str
    content: str
    created_at: float
    finish_reason: str | None = None
    stopped: bool = False
    stats: dict | None = None
    context: dict | None = None
    children: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)
