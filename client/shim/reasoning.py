"""Reasoning output: ``<think>…</think>`` split from the answer (``--reasoning-parser deepseek_r1``).

DeepSeek-R1-style templates open ``<think>`` in the prompt, so the output *starts* inside the
thinking: everything up to ``</think>`` is reasoning, the rest is the answer. A ``<think>`` the
model writes itself at the very start is dropped. No ``</think>`` at all: all of it is reasoning
(vLLM's deepseek_r1 parser does the same)::

    "<think>"? reasoning… "</think>" answer…

The parser is incremental (a tag split across deltas is held back until it is known), and the
whole text fed at once splits exactly as the same text fed in pieces, so streamed
``reasoning_content`` deltas reassemble to the non-streamed field.

Per request, ``include_reasoning: false`` (vLLM's field) drops the reasoning from the answer
instead of returning it; the answer is split the same way.
"""
from __future__ import annotations

import dataclasses
import functools

from client.shim.format import Tally

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PARSERS = ("deepseek_r1",)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkParser:
    """feed(text) -> (reasoning delta, answer delta); finish() flushes what was held back."""

    def __init__(self) -> None:
        self.buf = ""
        self.mode = "start"             # start (a leading <think> may come) | think | answer

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        if self.mode == "start":
            stripped = self.buf.lstrip()
            if stripped.startswith(THINK_OPEN):
                self.buf, self.mode = stripped[len(THINK_OPEN):], "think"
            elif THINK_OPEN.startswith(stripped):
                return "", ""           # maybe the opening tag, not complete yet
            else:
                self.mode = "think"
        if self.mode == "answer":
            out, self.buf = self.buf, ""
            return "", out
        end = self.buf.find(THINK_CLOSE)
        if end >= 0:
            reasoning, answer = self.buf[:end], self.buf[end + len(THINK_CLOSE):]
            self.buf, self.mode = "", "answer"
            return reasoning, answer
        keep = _partial_suffix(self.buf, THINK_CLOSE)
        reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        if self.mode == "answer":
            return "", rest
        self.mode = "answer"
        return rest, ""                 # an unclosed (or never opened) thought is reasoning


def parses_reasoning(parser: str | None, chat) -> bool:
    """Whether a chat request's output is split. Not when a grammar binds the output from its first
    token (a JSON ``response_format``, ``tool_choice`` required or named, ``guided_json`` /
    ``guided_choice``): it cannot hold a thought, and an answer without ``</think>`` would all be
    taken for one. ``guided_regex`` / ``guided_grammar`` may spell the thought out, so they keep it."""
    if not parser:
        return False
    fmt = (chat.response_format or {}).get("type")
    choice = chat.tool_choice if chat.tools else None
    return not (fmt in ("json_schema", "json_object") or choice == "required" or isinstance(choice, dict)
                or chat.guided_json is not None or chat.guided_choice is not None)


def split_reasoning(text: str) -> tuple[str, str]:
    """Whole output -> (reasoning, answer)."""
    p = ThinkParser()
    r1, a1 = p.feed(text)
    r2, a2 = p.finish()
    return r1 + r2, a1 + a2


@functools.cache
def with_reasoning(base: type[Tally]) -> type[Tally]:
    """A chat Tally class (``Tally`` or ``ToolTally``) whose choices' thinking goes to
    ``message.reasoning_content`` (``delta.reasoning_content`` when streaming) and whose tool
    parsing, if any, sees the answer only."""

    class ReasoningTally(base):
        def __init__(self, *, include_reasoning: bool = True, **kw) -> None:
            super().__init__(**kw)
            self.include_reasoning = include_reasoning
            self.think = {i: ThinkParser() for i in range(self.num_choices)}
            self.reasoning = {i: [] for i in range(self.num_choices)}
            self._split_done = False            # streaming: chunks reach add() already split

        def _split(self, index: int, chunk):
            p = self.think[index]
            reasoning, answer = p.feed(chunk.text)
            if chunk.finish_reason:
                r2, a2 = p.finish()
                reasoning, answer = reasoning + r2, answer + a2
            if reasoning:
                self.reasoning[index].append(reasoning)
            return reasoning, dataclasses.replace(chunk, text=answer)

        def add(self, index: int, prompt_index: int, chunk) -> None:
            if not self._split_done:            # the non-streamed path (collect)
                _, chunk = self._split(index, chunk)
            super().add(index, prompt_index, chunk)

        def response(self) -> dict:
            body = super().response()
            if self.include_reasoning:
                for ch in body["choices"]:
                    ch["message"]["reasoning_content"] = "".join(self.reasoning[ch["index"]]) or None
            return body

        def chunk_events(self, index: int, prompt_index: int, chunk) -> list[str]:
            self._split_done = True
            reasoning, chunk = self._split(index, chunk)
            events = []
            if reasoning and self.include_reasoning:
                events.append(self._event([{"index": index, "delta": {"reasoning_content": reasoning},
                                            "logprobs": None, "finish_reason": None}]))
            return events + super().chunk_events(index, prompt_index, chunk)

    ReasoningTally.__name__ = f"Reasoning{base.__name__}"
    return ReasoningTally
