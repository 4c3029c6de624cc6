"""``POST /v1/messages`` (Anthropic Messages) on the chat generation path, and its error shape.

The body becomes a chat request (client/shim/anthropic_schema.py), generated like any chat
completion (client/shim/generation.py) and answered in Anthropic's shape
(client/shim/anthropic_format.py). The key comes as ``x-api-key`` (Anthropic's header) or as
``Authorization: Bearer``: the same keys, tenants and limits as the OpenAI routes.

Every error on this route is in Anthropic's shape (``{"type": "error", "error": {"type",
"message"}}``): the shared checks (body limit, auth, validation, server errors) answer in the shape
of the request's path (client/shim/errors.py), so other routes never run this file's code.
"""
from __future__ import annotations

import uuid

from fastapi import APIRouter, Depends, Request

from client.shim.anthropic_format import MessagesTally
from client.shim.anthropic_schema import MessagesRequest, to_chat
from client.shim.errors import ANTHROPIC_PATH, unauthorized
from client.shim.generation import adapter_for, respond_chat
from client.shim.reasoning import parses_reasoning
from client.shim.tenants import KeyPolicy
from client.shim.tools import parses_tool_calls

router = APIRouter()


async def anthropic_key(request: Request) -> KeyPolicy:
    """``x-api-key`` when sent, else the Bearer key (client/shim/tenants.py)."""
    keys = request.app.state.keys
    given = request.headers.get("x-api-key")
    if given is None or keys.open:
        return keys.identify(request)
    policy = keys.policy_of(given.strip()) if given.strip() else None
    if policy is None:
        raise unauthorized("Invalid or missing API key: send it as 'x-api-key: KEY' or 'Authorization: Bearer KEY'.")
    return policy


@router.post(ANTHROPIC_PATH)
async def create_message(body: MessagesRequest, request: Request, key: KeyPolicy = Depends(anthropic_key)):
    adapter_for(request.app.state, body.model)         # 404 unless served (or an adapter)
    body.check_supported()
    chat = to_chat(body)
    tally = MessagesTally(request_id=f"msg_{uuid.uuid4().hex}", body=body,
                          reasoning=parses_reasoning(request.app.state.settings.reasoning_parser, chat),
                          tools=parses_tool_calls(chat))
    return await respond_chat(request, key, chat, tally, body.param_names(), "messages")
