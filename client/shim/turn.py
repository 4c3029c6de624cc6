"""One assistant turn's text -> typed parts, for the APIs whose output is a list of blocks
(Responses' output items, Anthropic's content blocks).

    text deltas ─► ThinkParser (--reasoning-parser) ─► ToolCallParser (when tools were sent) ─► parts

A part is ``("reasoning", text)``, ``("text", text)``, ``("call", {"index", "id", "name"})`` (a tool
call opens) or ``("args", {"index", "arguments"})`` (its arguments grow). Fed in pieces or whole,
the parts join to the same turn (both parsers are incremental), so a stream and the non-streamed
body agree. :class:`TurnTally` follows one single-choice generation with the base ``Tally``'s
accounting (usage, timing headers) and hands each chunk's parts to the API's own formatter.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from client.shim.format import Tally
from client.shim.reasoning import ThinkParser
from client.shim.tools import ToolCallParser


@dataclass
class Turn:
    """The whole turn, assembled from its parts."""
    reasoning: str = ""
    text: str = ""
    calls: list[dict] = field(default_factory=list)     # {"id", "name", "arguments"}

    def take(self, parts: list[tuple[str, dict | str]]) -> None:
        for kind, value in parts:
            if kind == "reasoning":
                self.reasoning += value
            elif kind == "text":
                self.text += value
            elif kind == "call":
                self.calls.append({"id": value["id"], "name": value["name"], "arguments": ""})
            else:
                self.calls[value["index"]]["arguments"] += value["arguments"]


class TurnParser:
    def __init__(self, *, reasoning: bool, tools: bool) -> None:
        self.think = ThinkParser() if reasoning else None
        self.tools = ToolCallParser() if tools else None

    def feed(self, text: str, final: bool = False) -> list[tuple[str, dict | str]]:
        reasoning, answer = "", text
        if self.think is not None:
            reasoning, answer = self.think.feed(text)
            if final:
                r2, a2 = self.think.finish()
                reasoning, answer = reasoning + r2, answer + a2
        parts: list = [("reasoning", reasoning)] if reasoning else []
        if self.tools is None:
            return parts + ([("text", answer)] if answer else [])
        content, deltas = self.tools.feed(answer)
        if final:
            more, more_deltas = self.tools.finish()
            content, deltas = content + more, deltas + more_deltas
        if content:
            parts.append(("text", content))
        for d in deltas:
            if "id" in d:
                parts.append(("call", {"index": d["index"], "id": d["id"], "name": d["function"]["name"]}))
            if d["function"].get("arguments"):
                parts.append(("args", {"index": d["index"], "arguments": d["function"]["arguments"]}))
        return parts


class TurnTally(Tally):
    """A single-choice chat generation whose output is parsed into a :class:`Turn` as it arrives
    (streamed or not: the same parser, so both agree). Subclasses make the API's body
    (``response``) and stream (``start_events``, ``parts_events``, ``end_events``) from it."""

    def __init__(self, *, request_id: str, model: str, reasoning: bool, tools: bool) -> None:
        super().__init__(chat=True, request_id=request_id, model=model, num_choices=1, logprobs=False)
        self.parser = TurnParser(reasoning=reasoning, tools=tools)
        self.turn = Turn()
        self.reasoning_tokens = 0               # output tokens spent thinking (see add)
        self._parts: list = []

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason

    def add(self, index: int, prompt_index: int, chunk) -> None:
        before = self.choices[0].completion_tokens
        super().add(index, prompt_index, chunk)
        self._parts = self.parser.feed(chunk.text, final=bool(chunk.finish_reason))
        self.turn.take(self._parts)
        # A chunk's tokens are not mapped to characters here: a chunk carrying both thinking and
        # answer (a non-streamed body is one chunk) counts its tokens in proportion to characters.
        thought = sum(len(v) for k, v in self._parts if k == "reasoning")
        if thought:
            rest = sum(len(v) if isinstance(v, str) else len(v.get("arguments", "")) + 1
                       for k, v in self._parts if k != "reasoning")
            self.reasoning_tokens += round((self.choices[0].completion_tokens - before) * thought / (thought + rest))
        self._begin()
        for kind, value in self._parts:             # the subclass's _on_reasoning / _on_text / _on_call / _on_args
            getattr(self, f"_on_{kind}")(value)
        if chunk.finish_reason:
            self._close()

    def _begin(self) -> None:
        """Before each chunk's parts (an API's opening event goes here)."""

    def _close(self) -> None:
        raise NotImplementedError

    def chunk_events(self, index: int, prompt_index: int, chunk) -> list[str]:
        self.add(index, prompt_index, chunk)
        return self.parts_events(self._parts, chunk.finish_reason)

    def parts_events(self, parts: list, finish_reason: str | None) -> list[str]:
        raise NotImplementedError

    def error_event(self, err) -> str:
        raise NotImplementedError


def assistant_message(turn) -> dict:
    """A parsed turn as the chat message a later request sends back (thinking left out)."""
    msg: dict = {"role": "assistant", "content": turn.text if turn.text or not turn.calls else None}
    if turn.calls:
        msg["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"]}} for c in turn.calls]
    return msg
