"""``POST /v1/messages`` (Anthropic Messages) on the chat generation path, and its error shape.

The body becomes a chat request (client/shim/anthropic_schema.py), generated like any chat
completion (client/shim/generation.py) and answered in Anthropic's shape
(client/shim/anthropic_format.py). The key comes as ``x-api-key`` (Anthropic's header) or as
``Authorization: Bearer``: the same keys, tenants and limits as the OpenAI routes.

Every error on this route is in Anthropic's shape (``{"type": "error", "error": {"type",
"message"}}``): :class:`AnthropicErrors` (outermost ASGI middleware) reshapes the OpenAI-shaped
error bodies the shared checks make (body limit, auth, validation, server errors) for this path.
"""
from __future__ import annotations

import json
import logging
import uuid

from fastapi import APIRouter, Depends, Request

from client.shim.anthropic_format import MessagesTally, error_body
from client.shim.anthropic_schema import MessagesRequest, to_chat
from client.shim.errors import unauthorized
from client.shim.generation import respond_chat
from client.shim.lora import adapter_for
from client.shim.reasoning import parses_reasoning
from client.shim.tenants import KeyPolicy
from client.shim.tools import parses_tool_calls

log = logging.getLogger("triton_llm.shim")
router = APIRouter()
PATH = "/v1/messages"


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


@router.post(PATH)
async def create_message(body: MessagesRequest, request: Request, key: KeyPolicy = Depends(anthropic_key)):
    adapter_for(request.app.state, body.model)         # 404 unless served (or an adapter)
    body.check_supported()
    chat = to_chat(body)
    tally = MessagesTally(request_id=f"msg_{uuid.uuid4().hex}", body=body,
                          reasoning=parses_reasoning(request.app.state.settings.reasoning_parser, chat),
                          tools=parses_tool_calls(chat))
    return await respond_chat(request, key, chat, tally, body.param_names(), "messages")


class AnthropicErrors:
    """ASGI middleware: a JSON error answer on ``/v1/messages`` gets Anthropic's body shape (the
    status and headers stay); streams and successes pass through untouched."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith(PATH):
            await self.app(scope, receive, send)
            return
        held: dict = {}

        async def reshape(message) -> None:
            if message["type"] == "http.response.start":
                held["started"] = True
            if message["type"] == "http.response.start" and message["status"] >= 400:
                held["start"], held["body"] = message, b""
                return
            if message["type"] == "http.response.body" and "start" in held:
                held["body"] += message.get("body", b"")
                if message.get("more_body", False):
                    return
                start = held.pop("start")
                body = _reshaped(start["status"], held.pop("body"))
                headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
                headers.append((b"content-length", str(len(body)).encode()))
                await send(dict(start, headers=headers))
                await send({"type": "http.response.body", "body": body, "more_body": False})
                return
            await send(message)

        try:
            await self.app(scope, receive, reshape)
        except Exception:
            # Starlette's last-resort 500 is made outside this middleware, in OpenAI's shape
            if held.get("started"):
                raise
            log.exception("unhandled error on %s", PATH)
            body = json.dumps(error_body(500, "internal error")).encode()
            await send({"type": "http.response.start", "status": 500, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body, "more_body": False})


def _reshaped(status: int, body: bytes) -> bytes:
    try:
        value = json.loads(body)
    except ValueError:
        return json.dumps(error_body(status, body.decode(errors="replace") or "error")).encode()
    err = value.get("error") if isinstance(value, dict) else None
    if isinstance(value, dict) and value.get("type") == "error":
        return body                                 # already Anthropic's
    message = err.get("message") if isinstance(err, dict) else None
    if not isinstance(message, str):
        message = value.get("detail") if isinstance(value, dict) and isinstance(value.get("detail"), str) else "error"
    if isinstance(err, dict) and err.get("param") and err["param"] not in message:
        message = f"{err['param']}: {message}"
    return json.dumps(error_body(status, message), ensure_ascii=False).encode()
