"""The one generation path the other APIs' routes (Responses, Anthropic Messages) share with chat.

Each translates its body into a ``ChatCompletionRequest`` (messages, sampling, tools, grammar) and
hands it here with its own tally (its body and stream shape); the checks, the key's priority and
tenant, the concurrency slot, the gRPC stream, disconnect handling and error mapping are chat's own
(client/shim/routes.py).
"""
from __future__ import annotations

from fastapi import Request

from backend import timing
from client.shim.lora import adapter_for
from client.shim.routes import _check_prompt, _params, _respond, _state
from client.shim.schemas import ChatCompletionRequest
from client.shim.tenants import KeyPolicy


async def respond_chat(request: Request, key: KeyPolicy, chat: ChatCompletionRequest, tally,
                       param_names: dict[str, str], prompt_param: str):
    """Generate ``chat`` and answer with ``tally``'s shape (a whole body, or its SSE stream)."""
    await _check_prompt(request, chat.prompt_chars(), prompt_param)
    timing.mark(tally.id, "shim.recv")
    params = _params(request, chat, key, adapter_for(_state(request), chat.model))   # model -> adapter
    slot = _state(request).in_flight.acquire(key)
    agens = [_state(request).client.generate(messages=chat.messages_json(), request_id=tally.id,
                                             params=params, stream=chat.stream)]
    return await _respond(request, agens, tally, 1, chat.stream, param_names, slot)


def assistant_message(turn) -> dict:
    """A parsed turn as the chat message a later request sends back (thinking left out)."""
    msg: dict = {"role": "assistant", "content": turn.text if turn.text or not turn.calls else None}
    if turn.calls:
        msg["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"]}} for c in turn.calls]
    return msg
