"""The chat store's records: a conversation (its settings and current leaf) and a message (a node
of the conversation's tree, with its children's ids)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


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
