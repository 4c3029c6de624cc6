"""Tool calls in the shim: request fields -> server parameters, and the model's Hermes-style
``<tool_call>`` blocks (backend/structured/tool_spec.py) -> OpenAI ``tool_calls``.

One incremental parser (:class:`ToolCallParser`) serves both response shapes: the non-streamed
message runs it over the whole text at once, the stream feeds it each delta, so streamed
tool-call deltas always reassemble to the non-streamed result. Per block::

    <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>
                 └── header: emits {id, type, function: {name, arguments: ""}}
                                                 └── arguments value: streamed as it is scanned
                                                     (raw text, JSON string/escape aware)

Text outside blocks is message content (``auto``); whitespace only around blocks is dropped. A
block whose header is not ``{"name": ..., "arguments": ...}`` is parsed once it closes; one that
is not JSON at all, or nests deeper than ``MAX_JSON_DEPTH``, stays content (arguments that deep
stay their raw text): the model's output never becomes a RecursionError and a 500. A choice with calls that ended with "stop" ends with
"tool_calls".
"""
from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from backend import protocol as P
from backend.structured.tool_spec import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from client.shim.format import Tally

MAX_JSON_DEPTH = 128        # nesting parsed from model output; deeper stays text (json recurses)
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:')


def structured_params(body) -> dict[str, Any]:
    """A request body's structured-output fields as server parameters (JSON values as JSON
    text): tools, tool_choice, parallel_tool_calls, response_format, logit_bias, guided_*."""
    p: dict[str, Any] = {}
    if getattr(body, "tools", None):
        p[P.TOOLS] = json.dumps(body.tools)
        if body.tool_choice is not None:
            choice = body.tool_choice
            p[P.TOOL_CHOICE] = choice if isinstance(choice, str) else json.dumps(choice)
        if body.parallel_tool_calls is not None:
            p[P.PARALLEL_TOOL_CALLS] = bool(body.parallel_tool_calls)
    elif getattr(body, "tool_choice", None) not in (None, "none", "auto"):
        p[P.TOOL_CHOICE] = json.dumps(body.tool_choice)       # the server says: tool_choice needs tools
    for name in (P.RESPONSE_FORMAT, P.LOGIT_BIAS, P.GUIDED_JSON, P.GUIDED_CHOICE):
        value = getattr(body, name, None)
        if value is not None:
            p[name] = value if isinstance(value, str) else json.dumps(value)
    for name in (P.GUIDED_REGEX, P.GUIDED_GRAMMAR):
        if getattr(body, name, None) is not None:
            p[name] = getattr(body, name)
    return p


def parses_tool_calls(body) -> bool:
    return bool(getattr(body, "tools", None)) and body.tool_choice != "none"


def json_depth(text: str) -> int:
    """The deepest ``{``/``[`` nesting of ``text`` outside JSON strings (no parsing, no recursion)."""
    depth = deepest = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "}]":
            depth -= 1
    return deepest


def loads_model_json(text: str):
    """json.loads for model output; ValueError for nesting past MAX_JSON_DEPTH too."""
    if json_depth(text) > MAX_JSON_DEPTH:
        raise ValueError("nested too deep")
    return json.loads(text)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    """feed(text) -> (content delta, tool-call deltas in OpenAI's stream shape); finish() flushes."""

    def __init__(self) -> None:
        self.buf = ""
        self.mode = "text"              # text | header | args | tail
        self.held_ws = ""               # whitespace not shown yet (dropped if a block follows)
        self.calls: list[dict] = []     # {"id", "name", "arguments"} as assembled so far
        self._depth = 0
        self._in_str = self._esc = self._started = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buf += text
        content, deltas = [], []
        while True:
            progressed = getattr(self, f"_step_{self.mode}")(content, deltas)
            if not progressed:
                return "".join(content), deltas

    def finish(self) -> tuple[str, list[dict]]:
        content, deltas = [], []
        if self.mode == "text":
            content.append(self.buf if self.calls else self.held_ws + self.buf)
        elif self.mode == "header":                 # unterminated block: parse what there is
            self._close_block(self.buf, content, deltas, closed=False)
        elif self.mode == "raw":
            self._raw_args(self.buf, deltas)
        self.buf, self.held_ws, self.mode = "", "", "text"
        return "".join(content), deltas

    # -- modes ----------------------------------------------------------------------------
    def _step_text(self, content: list, deltas: list) -> bool:
        pos = self.buf.find(TOOL_CALL_OPEN)
        if pos >= 0:
            self._emit_text(self.buf[:pos], content, final=True)
            self.buf = self.buf[pos + len(TOOL_CALL_OPEN):]
            self.mode = "header"
            return True
        keep = _partial_suffix(self.buf, TOOL_CALL_OPEN)
        self._emit_text(self.buf[:len(self.buf) - keep], content, final=False)
        self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _emit_text(self, text: str, content: list, final: bool) -> None:
        text = self.held_ws + text
        stripped = text.rstrip()
        if final:                                   # a block follows: its surrounding space goes
            stripped = stripped if stripped.strip() else ""
            if stripped:
                content.append(stripped)
            self.held_ws = ""
            return
        if stripped:
            content.append(stripped)
        self.held_ws = text[len(stripped):]

    def _step_header(self, content: list, deltas: list) -> bool:
        end = self.buf.find(TOOL_CALL_CLOSE)
        m = _HEADER.match(self.buf)
        if m and (end < 0 or m.end() <= end):
            name = json.loads(m.group(1))
            call = {"id": _call_id(), "name": name, "arguments": ""}
            self.calls.append(call)
            deltas.append({"index": len(self.calls) - 1, "id": call["id"], "type": "function",
                           "function": {"name": name, "arguments": ""}})
            self.buf = self.buf[m.end():]
            self.mode, self._depth, self._in_str, self._esc, self._started = "args", 0, False, False, False
            return True
        if end >= 0:                                # not our header shape: parse the whole block
            block, self.buf = self.buf[:end], self.buf[end + len(TOOL_CALL_CLOSE):]
            self._close_block(block, content, deltas, closed=True)
            self.mode = "text"
            return True
        return False

    def _step_args(self, content: list, deltas: list) -> bool:
        out, i = [], 0
        while i < len(self.buf):
            ch = self.buf[i]
            i += 1
            if not self._started:
                if ch.isspace():
                    continue
                if ch not in "{[":                  # not an object: taken whole when the block ends
                    self.buf = self.buf[i - 1:]
                    self.mode = "raw"
                    return True
                self._started = True
            out.append(ch)
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif ch == "\\":
                    self._esc = True
                elif ch == '"':
                    self._in_str = False
            elif ch == '"':
                self._in_str = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._args_delta("".join(out), deltas)
                    self.buf = self.buf[i:]
                    self.mode = "tail"
                    return True
        self.buf = ""
        if out:
            self._args_delta("".join(out), deltas)
        return False

    def _args_delta(self, text: str, deltas: list) -> None:
        self.calls[-1]["arguments"] += text
        deltas.append({"index": len(self.calls) - 1, "function": {"arguments": text}})

    def _step_raw(self, content: list, deltas: list) -> bool:
        end = self.buf.find(TOOL_CALL_CLOSE)
        if end < 0:
            return False
        self._raw_args(self.buf[:end], deltas)
        self.buf, self.mode = self.buf[end + len(TOOL_CALL_CLOSE):], "text"
        return True

    def _raw_args(self, raw: str, deltas: list) -> None:
        """Arguments given as a JSON string (or another value): the string's text, or the value."""
        raw = raw.rstrip()
        raw = raw[:-1].rstrip() if raw.endswith("}") else raw     # the call object's own brace
        try:
            value = loads_model_json(raw)
            text = value if isinstance(value, str) else json.dumps(value)
        except ValueError:
            text = raw
        self._args_delta(text, deltas)

    def _step_tail(self, content: list, deltas: list) -> bool:
        end = self.buf.find(TOOL_CALL_CLOSE)
        if end < 0:
            return False
        self.buf, self.mode = self.buf[end + len(TOOL_CALL_CLOSE):], "text"
        return True

    def _close_block(self, block: str, content: list, deltas: list, closed: bool) -> None:
        """A block without the usual header (or unterminated): parse it as a whole."""
        try:
            obj = loads_model_json(block)
            name = obj["name"]
            args = obj.get("arguments", obj.get("parameters", {}))
            if not isinstance(name, str):
                raise TypeError
        except (ValueError, KeyError, TypeError, AttributeError):
            content.append(TOOL_CALL_OPEN + block + (TOOL_CALL_CLOSE if closed else ""))
            return
        call = {"id": _call_id(), "name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}
        self.calls.append(call)
        deltas.append({"index": len(self.calls) - 1, "id": call["id"], "type": "function",
                       "function": {"name": name, "arguments": call["arguments"]}})


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """Whole output -> (content, [{"id", "name", "arguments"}])."""
    p = ToolCallParser()
    content, _ = p.feed(text)
    rest, _ = p.finish()
    return content + rest, p.calls


class ToolTally(Tally):
    """A chat Tally whose choices' text is parsed for tool calls (message.tool_calls, and
    ``delta.tool_calls`` chunks when streaming)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.parsers = {i: ToolCallParser() for i in range(self.num_choices)}

    def response(self) -> dict:
        body = super().response()
        for ch in body["choices"]:
            content, calls = parse_tool_calls(ch["message"]["content"])
            if calls:
                ch["message"]["content"] = content or None
                ch["message"]["tool_calls"] = [
                    {"id": c["id"], "type": "function",
                     "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
                if ch["finish_reason"] == "stop":
                    ch["finish_reason"] = "tool_calls"
        return body

    def chunk_events(self, index: int, prompt_index: int, chunk) -> list[str]:
        p = self.parsers[index]
        content, deltas = p.feed(chunk.text)
        if chunk.finish_reason:
            more, more_deltas = p.finish()
            content, deltas = content + more, deltas + more_deltas
        inner = dataclasses.replace(chunk, text=content, finish_reason=None, metrics=None)
        events = super().chunk_events(index, prompt_index, inner)
        for d in deltas:
            events.append(self._event([{"index": index, "delta": {"tool_calls": [d]}, "logprobs": None,
                                        "finish_reason": None}]))
        if chunk.finish_reason:
            finish = "tool_calls" if p.calls and chunk.finish_reason == "stop" else chunk.finish_reason
            last = dataclasses.replace(chunk, text="", logprobs=None, finish_reason=finish)
            events += super().chunk_events(index, prompt_index, last)
        return events
