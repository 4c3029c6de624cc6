"""Anthropic Messages' body, stream and error shape for one generation.

Content blocks follow the turn's parts (client/shim/turn.py): ``thinking`` (when asked for),
``text``, ``tool_use`` (ids ``toolu_…``; ``input`` the parsed arguments). Stream (SSE, ``event:``
named)::

    message_start (usage.input_tokens), ping
    per block: content_block_start, content_block_delta (text_delta | thinking_delta |
               input_json_delta)…, [signature_delta], content_block_stop
    message_delta (stop_reason, usage.output_tokens), message_stop

stop_reason: ``end_turn``, ``max_tokens``, ``tool_use``. The engine does not report which stop
string ended a generation, so a ``stop_sequences`` match is ``end_turn`` with ``stop_sequence``
null. Errors: ``{"type": "error", "error": {"type", "message"}}``; a failure after the stream
started ends it with an ``error`` event.
"""
from __future__ import annotations

from client.shim.errors import anthropic_body
from client.shim.format import dumps
from client.shim.tools import loads_model_json
from client.shim.turn import TurnTally


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict:
    try:
        value = loads_model_json(arguments) if arguments.strip() else {}
    except ValueError:
        return {"_raw": arguments}              # not JSON, or too deep (an unconstrained model): kept
    return value if isinstance(value, dict) else {"value": value}


class MessagesTally(TurnTally):
    def __init__(self, *, request_id: str, body, reasoning: bool, tools: bool) -> None:
        super().__init__(request_id=request_id, model=body.model, reasoning=reasoning, tools=tools)
        self.show_thinking = body.wants_thinking
        self.blocks: list[dict] = []
        self.open: dict | None = None
        self._events: list[str] = []
        self.streaming = False                  # set by start_events (the stream's first call)
        self._started = False

    def stop_reason(self) -> str | None:
        reason = self.finish_reason
        if reason is None:
            return None
        if reason == "length":
            return "max_tokens"
        return "tool_use" if self.turn.calls else "end_turn"

    def usage_a(self) -> dict:
        u = self.usage()
        cached = u["prompt_tokens_details"]["cached_tokens"]
        return {"input_tokens": u["prompt_tokens"] - cached, "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0, "output_tokens": u["completion_tokens"]}

    def _message(self, *, final: bool) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [self._done_block(b) for b in self.blocks] if final else [],
                "stop_reason": self.stop_reason() if final else None, "stop_sequence": None,
                "usage": self.usage_a()}

    def response(self) -> dict:
        return dict(self._message(final=True), triton_llm=self.timing())

    def _done_block(self, block: dict) -> dict:
        if block["type"] == "tool_use":
            return {"type": "tool_use", "id": block["id"], "name": block["name"], "input": _input(block["args"])}
        return dict(block)

    # -- blocks from parts (events kept for the stream) -----------------------------------------
    def _begin(self) -> None:
        if not self._started:                   # after the first chunk: its prompt_tokens are known
            self._started = True
            self._ev("message_start", message=self._message(final=False))
            self._ev("ping")

    def _ev(self, kind: str, **fields) -> None:
        if not self.streaming:                  # a whole body: the items only, no events to encode
            return
        self._events.append(f"event: {kind}\ndata: {dumps({'type': kind, **fields})}\n\n")

    def _open(self, block: dict, start: dict) -> dict:
        self._close()
        self.blocks.append(block)
        self.open = block
        self._ev("content_block_start", index=len(self.blocks) - 1, content_block=start)
        return block

    def _delta(self, delta: dict) -> None:
        self._ev("content_block_delta", index=len(self.blocks) - 1, delta=delta)

    def _on_reasoning(self, text: str) -> None:
        if not self.show_thinking:
            return
        if self.open is None or self.open["type"] != "thinking":
            self._open({"type": "thinking", "thinking": "", "signature": ""},
                       {"type": "thinking", "thinking": "", "signature": ""})
        self.open["thinking"] += text
        self._delta({"type": "thinking_delta", "thinking": text})

    def _on_text(self, text: str) -> None:
        if self.open is None or self.open["type"] != "text":
            self._open({"type": "text", "text": ""}, {"type": "text", "text": ""})
        self.open["text"] += text
        self._delta({"type": "text_delta", "text": text})

    def _on_call(self, call: dict) -> None:
        tid = _tool_id(call["id"])
        self._open({"type": "tool_use", "id": tid, "name": call["name"], "args": ""},
                   {"type": "tool_use", "id": tid, "name": call["name"], "input": {}})

    def _on_args(self, args: dict) -> None:
        self.open["args"] += args["arguments"]
        self._delta({"type": "input_json_delta", "partial_json": args["arguments"]})

    def _close(self) -> None:
        block, self.open = self.open, None
        if block is None:
            return
        if block["type"] == "thinking":         # no signature: thinking is not signed here
            self._delta({"type": "signature_delta", "signature": ""})
        self._ev("content_block_stop", index=self.blocks.index(block))

    # -- the stream -----------------------------------------------------------------------------
    def _take(self) -> list[str]:
        events, self._events = self._events, []
        return events

    def start_events(self) -> list[str]:
        self.streaming = True
        return []                               # message_start goes with the first chunk (add)

    def chunk_events(self, index: int, prompt_index: int, chunk) -> list[str]:
        self.add(index, prompt_index, chunk)
        return self._take()

    def end_events(self) -> list[str]:
        self._close()
        u = self.usage_a()
        self._ev("message_delta", delta={"stop_reason": self.stop_reason(), "stop_sequence": None},
                 usage={"output_tokens": u["output_tokens"], "input_tokens": u["input_tokens"],
                        "cache_read_input_tokens": u["cache_read_input_tokens"]})
        self._ev("message_stop")
        return self._take()

    def error_event(self, err) -> str:
        self._events = []
        self._ev("error", error=anthropic_body(err.status, err.message)["error"])
        return "".join(self._take())
