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
"""
from __future__ import annotations

import asyncio
import functools
import json
import pathlib
from dataclasses import asdict, dataclass
from typing import Awaitable, Callable

from client.chat.store import ChatStore, Conversation, Invalid, Message

Completer = Callable[..., Awaitable[str]]   # complete(messages, *, max_tokens, tenant) -> str

PROJECT_TOKENIZER = pathlib.Path(__file__).resolve().parents[2] / "backend" / "assets" / "tokenizer"
SUMMARY_HEADER = "Summary of the earlier part of this conversation:"
SUMMARIZE_INSTRUCTIONS = (
    "You write summaries of conversations. Summarize the conversation below in a few sentences, "
    "keeping facts, names, numbers, decisions and open questions. Reply with the summary only.")


class ContextTooLong(Invalid):
    """The newest turn alone does not fit the context window (HTTP 400)."""


class TokenCounter:
    """Counts prompt tokens the way the server will: the tokenizer's chat template, then encode.

    Without a tokenizer (none found) it estimates 1 token per 3 UTF-8 bytes plus 4 per message.
    """

    def __init__(self, tokenizer_dir: str | pathlib.Path | None = None):
        self.tokenizer = None
        for candidate in (tokenizer_dir, PROJECT_TOKENIZER):
            if candidate and (pathlib.Path(candidate) / "tokenizer.json").exists():
                from transformers import PreTrainedTokenizerFast

                self.tokenizer = PreTrainedTokenizerFast.from_pretrained(str(candidate))
                break
        self._message = functools.lru_cache(maxsize=8192)(self._message_tokens)
        probe = [{"role": "user", "content": "x"}]
        self._generation_prompt = (self._render_tokens(probe, add_generation_prompt=True)
                                   - self._render_tokens(probe, add_generation_prompt=False))

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode())[::3]
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def tail(self, text: str, max_tokens: int) -> str:
        """The end of ``text`` that fits in ``max_tokens`` tokens."""
        if self.tokenizer is None:
            return text.encode()[-3 * max_tokens:].decode(errors="ignore")
        ids = self.encode(text)
        return text if len(ids) <= max_tokens else self.tokenizer.decode(ids[-max_tokens:])

    def _render_tokens(self, messages: list[dict], add_generation_prompt: bool) -> int:
        if not messages:
            return self._generation_prompt if add_generation_prompt else 0
        if self.tokenizer is None:
            return sum(4 + len(m["content"].encode()) // 3 for m in messages) + (
                3 if add_generation_prompt else 0)
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        return len(self.encode(text))

    def _message_tokens(self, role: str, content: str) -> int:
        return self._render_tokens([{"role": role, "content": content}], False)

    def count(self, messages: list[dict]) -> int:
        """Prompt tokens of ``messages`` with the generation prompt (per-message sums, cached)."""
        return sum(self._message(m["role"], m["content"]) for m in messages) + self._generation_prompt

    def count_exact(self, messages: list[dict]) -> int:
        return self._render_tokens(messages, True)


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
    """How many of the last turns to keep: at most ``keep_turns``, fewer while over ``budget``."""
    keep = min(keep_turns, len(turns))
    while keep > 1 and counter.count(system + _chat(turns[-keep:])) > budget:
        keep -= 1
    return keep


class ContextBuilder:
    """Applies a conversation's policy to the path ending at a user message."""

    def __init__(self, store: ChatStore, counter: TokenCounter, max_model_len: int,
                 complete: Completer | None = None, summary_tokens: int | None = None):
        self.store = store
        self.counter = counter
        self.max_model_len = max_model_len
        self.complete = complete
        self.summary_tokens = summary_tokens or min(256, max(16, max_model_len // 8))
        self._locks: dict[str, asyncio.Lock] = {}

    async def build(self, tenant: str, conv: Conversation, leaf_id: str) -> ContextResult:
        path = await asyncio.to_thread(self.store.path, tenant, conv.id, leaf_id)
        if not path or path[-1].role != "user":
            raise Invalid("the context is computed for a user message (the one to answer)",
                          "leaf_id")
        turns = split_turns(path)
        max_tokens = reply_room(self.max_model_len, conv.max_tokens)
        budget = self.max_model_len - max_tokens
        system = _system(conv.system_prompt, None)
        keep = choose_kept(system, turns, conv.keep_turns, budget, self.counter)
        summary = None
        if keep < len(turns) and conv.policy == "summarize":
            # The summary must fit too: reserve its size (+ header) before choosing the turns.
            reserve = self.summary_tokens + len(self.counter.encode(SUMMARY_HEADER)) + 8
            keep = choose_kept(system, turns, conv.keep_turns, budget - reserve, self.counter)
            lock = self._locks.setdefault(conv.id, asyncio.Lock())
            async with lock:    # two tabs asking at once make one summary, not two
                summary = await self._summary(tenant, conv, turns[:-keep])
            system = _system(conv.system_prompt, summary)
        messages = system + _chat(turns[-keep:])
        prompt_tokens = self.counter.count_exact(messages)
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

    async def _summary(self, tenant: str, conv: Conversation, older: list[list[Message]]) -> str:
        """The summary of ``older`` turns: the cached one, or the latest cached one extended."""
        if self.complete is None:
            raise Invalid("the summarize policy needs a model to summarize with", "policy")
        start, summary = 0, None
        for i in range(len(older), 0, -1):           # newest cached summary of a prefix
            cached = await asyncio.to_thread(self.store.get_summary, tenant, conv.id, older[i - 1][-1].id)
            if cached is not None:
                start, summary = i, cached[0]
                break
        # Fold the remaining turns in, as many per call as fit the model's context.
        room = self.max_model_len - self.summary_tokens - 64
        i = start
        while i < len(older):
            j = i + 1
            while j < len(older) and self._summary_prompt_tokens(summary, older[i:j + 1]) <= room:
                j += 1
            prompt = self._summary_prompt(summary, older[i:j], room)
            text = await self.complete(prompt, max_tokens=self.summary_tokens, tenant=tenant)
            summary = (text or "").strip() or "(empty summary)"
            await asyncio.to_thread(self.store.put_summary, tenant, conv.id, older[j - 1][-1].id,
                                    summary, j)
            i = j
        assert summary is not None
        return summary

    @staticmethod
    def _transcript(previous: str | None, turns: list[list[Message]]) -> str:
        lines = [f"Summary so far:\n{previous}\n"] if previous else []
        lines.append("Conversation:")
        for turn in turns:
            for m in turn:
                lines.append(f"{m.role.capitalize()}: {m.content}")
        return "\n".join(lines)

    def _summary_prompt_tokens(self, previous: str | None, turns: list[list[Message]]) -> int:
        return self.counter.count([{"role": "system", "content": SUMMARIZE_INSTRUCTIONS},
                                   {"role": "user", "content": self._transcript(previous, turns)}])

    def _summary_prompt(self, previous: str | None, turns: list[list[Message]],
                        room: int) -> list[dict]:
        text = self._transcript(previous, turns)
        overhead = self.counter.count([{"role": "system", "content": SUMMARIZE_INSTRUCTIONS},
                                       {"role": "user", "content": ""}])
        if self._summary_prompt_tokens(previous, turns) > room:    # one turn longer than the window
            text = self.counter.tail(text, max(16, room - overhead - 8))
        return [{"role": "system", "content": SUMMARIZE_INSTRUCTIONS},
                {"role": "user", "content": text}]
