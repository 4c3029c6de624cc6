"""The Responses API's body and stream for one generation (``client.responses.create``).

Output items follow the turn's parts (client/shim/turn.py) in order: a ``reasoning`` item (with
``--reasoning-parser``), a ``message`` item with one ``output_text`` part, ``function_call`` items.
The items are built as chunks arrive on both paths, so a stream's items and ids are the final
body's. Stream (SSE, each event named by ``event:`` and numbered by ``sequence_number``)::

    response.created, response.in_progress                       status in_progress, output []
    per item: response.output_item.added
        message:   content_part.added, output_text.delta…, output_text.done, content_part.done
        reasoning: content_part.added, reasoning_text.delta…, reasoning_text.done, content_part.done
        function_call: function_call_arguments.delta…, function_call_arguments.done
      response.output_item.done
    response.completed (or response.incomplete: max_output_tokens)     the whole response + usage

A failure after the stream started ends it with an ``error`` event and ``response.failed``.
"""
from __future__ import annotations

import time
import uuid

from client.shim.format import dumps
from client.shim.turn import TurnTally


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesTally(TurnTally):
    def __init__(self, *, request_id: str, body, reasoning: bool, tools: bool, on_done=None) -> None:
        super().__init__(request_id=request_id, model=body.model, reasoning=reasoning, tools=tools)
        self.body, self.on_done = body, on_done
        self.created_at = int(time.time())
        self.seq = 0
        self.output: list[dict] = []            # items as built so far
        self.open: dict | None = None           # the item still growing (its events not closed)
        self._events: list[str] = []
        self.streaming = False                  # set by start_events (the stream's first call)
        self._reported = False

    # -- the body -------------------------------------------------------------------------------
    def status(self) -> str:
        if not self.done:
            return "in_progress"
        return "incomplete" if self.finish_reason == "length" else "completed"

    def envelope(self, *, final: bool) -> dict:
        b = self.body
        fmt = (b.text or {}).get("format") or {"type": "text"}
        status = self.status() if final else "in_progress"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if final and status == "completed" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if final and status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model,
            "output": [self._done_item(it) for it in self.output] if final else [],
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id, "reasoning": b.reasoning or {"effort": None, "summary": None},
            "store": b.store is not False, "temperature": b.temperature, "text": {"format": fmt},
            "tool_choice": b.tool_choice or "auto", "tools": b.tools or [], "top_p": b.top_p,
            "truncation": b.truncation or "disabled", "usage": self.usage_r() if final else None,
            "user": b.user, "metadata": b.metadata or {}, "triton_llm": self.timing() if final else None,
        }

    def usage_r(self) -> dict:
        u = self.usage()
        return {"input_tokens": u["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                                         "cache_write_tokens": 0},
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": u["total_tokens"]}

    def response(self) -> dict:
        return self._report()

    def _done_item(self, item: dict) -> dict:
        item = dict(item, status="incomplete" if self.finish_reason == "length" else "completed")
        if item["type"] == "message":
            item["content"] = [dict(p) for p in item["content"]]
        return item

    def _report(self) -> dict:
        """The final body; the first time, handed to ``on_done`` with the turn (to be stored)."""
        body = self.envelope(final=True)
        if not self._reported and self.on_done is not None and self.done:
            self._reported = True
            self.on_done(self.turn, body)
        return body

    # -- items, built from parts (events kept for the stream) ---------------------------------
    def _ev(self, kind: str, **fields) -> None:
        if not self.streaming:                  # a whole body: the items only, no events to encode
            return
        fields = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        self._events.append(f"event: {kind}\ndata: {dumps(fields)}\n\n")

    def _open(self, item: dict) -> dict:
        self._close()
        self.output.append(item)
        self.open = item
        self._ev("response.output_item.added", output_index=len(self.output) - 1,
                 item=dict(item, status="in_progress"))
        return item

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.output.index(item)}

    def _on_reasoning(self, text: str) -> None:
        if not self.body.include_reasoning:         # split off, then dropped (vLLM's include_reasoning)
            return
        item = self.open
        if item is None or item["type"] != "reasoning":
            item = self._open({"id": _id("rs"), "type": "reasoning", "summary": [],
                               "content": [{"type": "reasoning_text", "text": ""}]})
            self._ev("response.content_part.added", **self._where(item), content_index=0,
                     part={"type": "reasoning_text", "text": ""})
        item["content"][0]["text"] += text
        self._ev("response.reasoning_text.delta", **self._where(item), content_index=0, delta=text)

    def _on_text(self, text: str) -> None:
        item = self.open
        if item is None or item["type"] != "message":
            item = self._open({"id": _id("msg"), "type": "message", "role": "assistant",
                               "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]})
            self._ev("response.content_part.added", **self._where(item), content_index=0,
                     part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        item["content"][0]["text"] += text
        self._ev("response.output_text.delta", **self._where(item), content_index=0, delta=text, logprobs=[])

    def _on_call(self, call: dict) -> None:
        self._open({"id": _id("fc"), "type": "function_call", "call_id": call["id"], "name": call["name"],
                    "arguments": ""})

    def _on_args(self, args: dict) -> None:
        item = self.open
        item["arguments"] += args["arguments"]
        self._ev("response.function_call_arguments.delta", **self._where(item), delta=args["arguments"])

    def _close(self) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        where = self._where(item)
        if item["type"] == "message":
            part = item["content"][0]
            self._ev("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            self._ev("response.content_part.done", **where, content_index=0, part=dict(part))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            self._ev("response.reasoning_text.done", **where, content_index=0, text=part["text"])
            self._ev("response.content_part.done", **where, content_index=0, part=dict(part))
        else:
            self._ev("response.function_call_arguments.done", **where, arguments=item["arguments"])
        self._ev("response.output_item.done", output_index=where["output_index"], item=self._done_item(item))

    # -- the stream -----------------------------------------------------------------------------
    def start_events(self) -> list[str]:
        self.streaming = True
        self._ev("response.created", response=self.envelope(final=False))
        self._ev("response.in_progress", response=self.envelope(final=False))
        return self._take()

    def _take(self) -> list[str]:
        events, self._events = self._events, []
        return events

    def chunk_events(self, index: int, prompt_index: int, chunk) -> list[str]:
        self.add(index, prompt_index, chunk)
        return self._take()

    def end_events(self) -> list[str]:
        self._close()
        final = self._report()
        self._ev("response.completed" if final["status"] == "completed" else "response.incomplete",
                 response=final)
        return self._take()

    def error_event(self, err) -> str:
        """``error``, then ``response.failed`` carrying it (never ``response.completed``)."""
        self._ev("error", code=err.code or err.type, message=err.message, param=err.param)
        failed = dict(self.envelope(final=False), status="failed",
                      error={"code": err.code or err.type, "message": err.message})
        self._ev("response.failed", response=failed)
        return "".join(self._take())
