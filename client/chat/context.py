"""Context-window policy: which messages of a conversation path are sent to the model.

A path is cut into turns, each starting at a user message:

    system | u1 a1 | u2 a2 | u3 a3 | u4            <- the leaf (a user message awaiting a reply)
           '--- older ----'  '--- last N turns ---'

The prompt must fit ``max_model_len - max_tokens`` (room for the reply).
- ``truncate`` (default): keep the system prompt and the last N turns, then drop the oldest of
  those while the prompt is still too long (the last turn always stays).
- ``summarize``: the turns that truncate would drop are summarized by the model itself; the
  summary rides in the system message. Summaries are cached per conversation, keyed by the last
  message they cover (a message id fixes the whole path above it), and a new summary folds the
  newer turns into the latest cached one, so each turn costs at most one model call.

Cost: every token count runs in a worker thread (``asyncio.to_thread``), never on the shim's event
loop, and is linear in the path: each message is tokenized once (its count cached under a digest
of its text, in a cache bounded by bytes), the kept turns are chosen in one pass from the newest,
and a summary's transcript is measured as the sum of its lines' counts.
"""
from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass
from typing import Any, Awaitable, Callable

from client.chat.store import ChatStore, Conversation, Invalid, Message
from client.chat.tokens import CountCache, TokenCounter  # noqa: F401 (re-exported)

Completer = Callable[..., Awaitable[str]]   # complete(messages, *, max_tokens, tenant[, policy]) -> str

SUMMARY_HEADER = "Summary of the earlier part of this conversation:"
SUMMARIZE_INSTRUCTIONS = (
    "You write summaries of conversations. Summarize the conversation below in a few sentences, "
    "keeping facts, names, numbers, decisions and open questions. Reply with the summary only.")


class ContextTooLong(Invalid):
    """The newest turn alone does not fit the context window (HTTP 400)."""


@dataclass
class ContextResult:
    """What the page sends for a reply, and what it tells the user about it."""
    messages: list[dict]        # OpenAI chat messages for /v1/chat/completions
    policy: str                 # the conversation's policy: truncate | summarize
    applied: bool               # True when older turns were dropped or summarized
    dropped_turns: int          # turns left out of the prompt (summarized ones included)
    summarized_turns: int       # turns covered by the summary (0 under truncate)
    summary: str | None
    kept_turns: int
    prompt_tokens: int          # our count of the prompt
    max_tokens: int             # room left for the reply
    max_model_len: int

    def to_json(self) -> dict:
        return asdict(self)

    def note(self) -> dict:
        """The part stored on the assistant message (the page shows it as a notice)."""
        return {k: v for k, v in self.to_json().items() if k not in ("messages", "summary")}


def split_turns(path: list[Message]) -> list[list[Message]]:
    turns: list[list[Message]] = []
    for m in path:
        if m.role == "user" or not turns:
            turns.append([m])
        else:
            turns[-1].append(m)
    return turns


def _chat(turns: list[list[Message]]) -> list[dict]:
    return [{"role": m.role, "content": m.content} for turn in turns for m in turn]


def _system(prompt: str, summary: str | None) -> list[dict]:
    parts = [p for p in (prompt, f"{SUMMARY_HEADER}\n{summary}" if summary else "") if p]
    return [{"role": "system", "content": "\n\n".join(parts)}] if parts else []


def reply_room(max_model_len: int, max_tokens: int | None) -> int:
    """Tokens kept free for the reply: the conversation's max_tokens, else a quarter (<= 512)."""
    room = max_tokens if max_tokens else min(512, max(16, max_model_len // 4))
    return min(room, max_model_len - 1)


def choose_kept(system: list[dict], turns: list[list[Message]], keep_turns: int, budget: int,
                counter: TokenCounter) -> int:
    """How many of the last turns to keep: the most (at most ``keep_turns``, at least 1) whose
    prompt fits ``budget``, in one pass from the newest turn."""
    total, keep = counter.count(system), 0
    for turn in reversed(turns[len(turns) - min(keep_turns, len(turns)):]):
        total += sum(counter.message(m.role, m.content) for m in turn)
        if keep and total > budget:
            break
        keep += 1
    return max(keep, 1)


class ContextBuilder:
    """Applies a conversation's policy to the path ending at a user message."""

    def __init__(self, store: ChatStore, counter: TokenCounter, max_model_len: int,
                 complete: Completer | None = None, summary_tokens: int | None = None):
        self.store = store
        self.counter = counter
        self.max_model_len = max_model_len
        self.complete = complete
        self.summary_tokens = summary_tokens or min(256, max(16, max_model_len // 8))
        self._locks: dict[str, asyncio.Lock] = {}     # per conversation while a summary is made

    async def build(self, tenant: str, conv: Conversation, leaf_id: str, *,
                    policy: Any = None) -> ContextResult:
        """``policy``: the caller's key policy, which a summary's model call runs under (its
        ``max_concurrent`` and priority ceiling, like any generation)."""
        path = await asyncio.to_thread(self.store.path, tenant, conv.id, leaf_id)
        if not path or path[-1].role != "user":
            raise Invalid("the context is computed for a user message (the one to answer)",
                          "leaf_id")
        turns = split_turns(path)
        max_tokens = reply_room(self.max_model_len, conv.max_tokens)
        budget = self.max_model_len - max_tokens
        system = _system(conv.system_prompt, None)
        keep = await asyncio.to_thread(choose_kept, system, turns, conv.keep_turns, budget, self.counter)
        summary = None
        if keep < len(turns) and conv.policy == "summarize":
            # The summary must fit too: reserve its size (+ header) before choosing the turns.
            def kept_with_reserve() -> int:
                reserve = self.summary_tokens + self.counter.text(SUMMARY_HEADER) + 8
                return choose_kept(system, turns, conv.keep_turns, budget - reserve, self.counter)
            keep = await asyncio.to_thread(kept_with_reserve)
            lock = self._locks.setdefault(conv.id, asyncio.Lock())
            try:
                async with lock:    # two tabs asking at once make one summary, not two
                    summary = await self._summary(tenant, conv, turns[:-keep], policy)
            finally:
                if not lock.locked() and self._locks.get(conv.id) is lock:
                    del self._locks[conv.id]
            system = _system(conv.system_prompt, summary)
        messages = system + _chat(turns[-keep:])
        prompt_tokens = await asyncio.to_thread(self.counter.count_exact, messages)
        if prompt_tokens > budget:
            raise ContextTooLong(
                f"the message does not fit the model's context: the prompt is {prompt_tokens} tokens "
                f"and {max_tokens} are kept for the reply, more than max_model_len "
                f"{self.max_model_len}; shorten the message, the system prompt or max_tokens",
                "content")
        dropped = len(turns) - keep
        return ContextResult(messages=messages, policy=conv.policy, applied=dropped > 0,
                             dropped_turns=dropped,
                             summarized_turns=dropped if summary is not None else 0,
                             summary=summary, kept_turns=keep, prompt_tokens=prompt_tokens,
                             max_tokens=max_tokens, max_model_len=self.max_model_len)

    async def _summary(self, tenant: str, conv: Conversation, older: list[list[Message]],
                       policy: Any = None) -> str:
        """The summary of ``older`` turns: the cached one, or the latest cached one extended."""
        if self.complete is None:
            raise Invalid("the summarize policy needs a model to summarize with", "policy")
        cached = await asyncio.to_thread(self.store.summaries, tenant, conv.id)
        start, summary = 0, None
        for i in range(len(older), 0, -1):           # newest cached summary of a prefix
            hit = cached.get(older[i - 1][-1].id)
            if hit is not None:
                start, summary = i, hit[0]
                break
        # Fold the remaining turns in, as many per call as fit the model's context.
        room = self.max_model_len - self.summary_tokens - 64
        extra = {"policy": policy} if policy is not None else {}
        i = start
        while i < len(older):
            j, prompt = await asyncio.to_thread(self._next_fold, summary, older, i, room)
            text = await self.complete(prompt, max_tokens=self.summary_tokens, tenant=tenant, **extra)
            summary = (text or "").strip() or "(empty summary)"
            await asyncio.to_thread(self.store.put_summary, tenant, conv.id, older[j - 1][-1].id,
                                    summary, j)
            i = j
        assert summary is not None
        return summary

    def _next_fold(self, previous: str | None, older: list[list[Message]], i: int,
                   room: int) -> tuple[int, list[dict]]:
        """(end, prompt) of the next summary call: turns ``older[i:end]``, as many as fit
        ``room``, measured as the sum of the transcript's line counts (one pass)."""
        c = self.counter
        total = (c.count([{"role": "system", "content": SUMMARIZE_INSTRUCTIONS},
                          {"role": "user", "content": ""}])
                 + (c.text(f"Summary so far:\n{previous}\n") if previous else 0) + c.text("Conversation:"))
        j = i
        while j < len(older):
            total += sum(c.text(_line(m)) + 1 for m in older[j])      # + 1: the newline
            if j > i and total > room:
                break
            j += 1
        text = self._transcript(previous, older[i:j])
        if j == i + 1 and total > room:                  # one turn longer than the window
            overhead = c.count([{"role": "system", "content": SUMMARIZE_INSTRUCTIONS},
                                {"role": "user", "content": ""}])
            text = c.tail(text, max(16, room - overhead - 8))
        return j, [{"role": "system", "content": SUMMARIZE_INSTRUCTIONS},
                   {"role": "user", "content": text}]

    @staticmethod
    def _transcript(previous: str | None, turns: list[list[Message]]) -> str:
        lines = [f"Summary so far:\n{previous}\n"] if previous else []
        lines.append("Conversation:")
        lines += [_line(m) for turn in turns for m in turn]
        return "\n".join(lines)


def _line(m: Message) -> str:
    return f"{m.role.capitalize()}: {m.content}"
