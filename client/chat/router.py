"""REST API of the chat page: conversations, their message trees, branches and context windows.

Every route authenticates through ``app.state.authenticate(request) -> tenant`` (the shim's API-key
check) and passes the tenant to the store, which scopes every query by it. Store calls run in the
thread pool (SQLite blocks; the event loop serves token streams), and so does turning a
conversation or the list of them into JSON (one ``json.dumps`` per message or conversation, so the
GIL changes hands in between).
Errors use the OpenAI error shape ``{"error": {"message", "type", "param", "code"}}``; a tenant at
its storage quota gets 429 ``insufficient_quota``. See docs/chat.md.
"""
from __future__ import annotations

import inspect
import json
from typing import Any, Awaitable, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from client.chat.context import ContextBuilder
from client.chat.store import POLICIES, ChatStore, Invalid, NotFound, QuotaExceeded

TITLE_CHARS = 48


class ConversationIn(BaseModel):
    """Create/update body; only the fields present are applied (validated by the store)."""
    model_config = ConfigDict(extra="forbid")
    title: Any = None
    system_prompt: Any = None
    policy: Any = None
    keep_turns: Any = None
    max_tokens: Any = None
    params: Any = None

    def fields(self) -> dict:
        return {k: getattr(self, k) for k in self.model_fields_set}


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str = "user"
    content: Any = None
    parent_id: str | None = None     # absent: the current leaf; null: a new root
    finish_reason: str | None = None
    stopped: bool = False
    stats: Any = None
    context: Any = None


class EditIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    content: Any = None


class LeafIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    message_id: str
    descend: bool = True


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def install_error_handlers(app) -> None:
    async def not_found(request: Request, exc: NotFound):
        return JSONResponse(error_body(str(exc), "not_found_error", None, "not_found"), 404)

    async def invalid(request: Request, exc: Invalid):
        return JSONResponse(error_body(str(exc), "invalid_request_error", exc.param), 400)

    async def over_quota(request: Request, exc: QuotaExceeded):
        return JSONResponse(error_body(str(exc), "insufficient_quota", exc.param, "insufficient_quota"), 429)

    app.add_exception_handler(NotFound, not_found)
    app.add_exception_handler(Invalid, invalid)
    app.add_exception_handler(QuotaExceeded, over_quota)


async def tenant_of(request: Request) -> str:
    tenant = request.app.state.authenticate(request)
    if inspect.isawaitable(tenant):
        tenant = await tenant
    return tenant


def key_policy(request: Request) -> Any:
    """The caller's key policy (client/shim/tenants.py) where the app has a key store, else None:
    a summary's model call runs under it."""
    keys = getattr(request.app.state, "keys", None)
    return keys.identify(request) if keys is not None else None


def json_response(body: bytes, status: int = 200) -> Response:
    return Response(body, status_code=status, media_type="application/json")


def build_router(store: ChatStore, builder: Callable[[], Awaitable[ContextBuilder]], config: dict,
                 window: Callable[[], Awaitable[int]]) -> APIRouter:
    """``await builder()`` returns the ContextBuilder (made lazily: it loads the tokenizer);
    ``await window()`` the context window the page reports as ``max_model_len``."""
    api = APIRouter(prefix="/api")
    run = run_in_threadpool            # every SQLite call runs off the event loop

    def tree(tenant: str, conv_id: str) -> bytes:
        """The conversation as JSON text, made off the event loop piece by piece."""
        conv = store.get_conversation(tenant, conv_id)
        messages = store.messages(tenant, conv_id)
        path = [m.id for m in store.path(tenant, conv_id)]
        roots = [m.id for m in messages.values() if m.parent_id is None]
        parts = [b'{"conversation": ', json.dumps(conv.to_json()).encode(), b', "messages": [']
        for k, m in enumerate(messages.values()):
            parts += [b", " if k else b"", json.dumps(m.to_json()).encode()]
        parts.append(f'], "root_ids": {json.dumps(roots)}, "path": {json.dumps(path)}}}'.encode())
        return b"".join(parts)

    async def context_json(tenant: str, conv_id: str, leaf_id: str, policy: Any) -> dict:
        conv = await run(store.get_conversation, tenant, conv_id)
        result = await (await builder()).build(tenant, conv, leaf_id, policy=policy)
        return {**result.to_json(), "params": conv.params}

    async def add_user_message(tenant: str, conv_id: str, previous_leaf: str | None, policy: Any,
                               **fields) -> Response:
        """Store a user message and compute its context; a message whose context is refused
        (too long, ...) is taken back, so the leaf stays where it was and nothing dangles."""
        msg = await run(lambda: store.add_message(tenant, conv_id, role="user", **fields))
        try:
            context = await context_json(tenant, conv_id, msg.id, policy)
        except BaseException:
            await run(store.retract_message, tenant, conv_id, msg.id, previous_leaf)
            raise
        return json_response(await run(lambda: json.dumps({"message": msg.to_json(),
                                                            "context": context}).encode()), 201)

    def autotitle(tenant: str, conv_id: str, content: str) -> None:
        conv = store.get_conversation(tenant, conv_id)
        if conv.title == "New chat":
            text = " ".join(content.split())
            title = text if len(text) <= TITLE_CHARS else text[:TITLE_CHARS - 1].rstrip() + "…"
            store.update_conversation(tenant, conv_id, title=title or "New chat")

    @api.get("/config")
    async def get_config(tenant: str = Depends(tenant_of)):
        return {**config, "max_model_len": await window(), "policies": list(POLICIES)}

    def listing(tenant: str) -> bytes:
        """The tenant's conversations as JSON text (up to its quota of them, system prompts and
        all: ~25 ms of the event loop when FastAPI encoded them there)."""
        parts = [json.dumps(c.to_json()).encode() for c in store.list_conversations(tenant)]
        return b'{"data": [' + b", ".join(parts) + b"]}"

    @api.get("/conversations")
    async def list_conversations(tenant: str = Depends(tenant_of)):
        return json_response(await run(listing, tenant))

    @api.post("/conversations", status_code=201)
    async def create_conversation(body: ConversationIn | None = None,
                                  tenant: str = Depends(tenant_of)):
        fields = body.fields() if body else {}
        fields.setdefault("keep_turns", config["default_keep_turns"])
        return (await run(lambda: store.create_conversation(tenant, **fields))).to_json()

    @api.get("/conversations/{conv_id}")
    async def get_conversation(conv_id: str, tenant: str = Depends(tenant_of)):
        return json_response(await run(tree, tenant, conv_id))

    @api.patch("/conversations/{conv_id}")
    async def update_conversation(conv_id: str, body: ConversationIn,
                                  tenant: str = Depends(tenant_of)):
        return (await run(lambda: store.update_conversation(tenant, conv_id, **body.fields()))).to_json()

    @api.delete("/conversations/{conv_id}", status_code=204)
    async def delete_conversation(conv_id: str, tenant: str = Depends(tenant_of)):
        await run(store.delete_conversation, tenant, conv_id)
        return Response(status_code=204)

    @api.post("/conversations/{conv_id}/messages", status_code=201)
    async def add_message(conv_id: str, body: MessageIn, request: Request,
                          tenant: str = Depends(tenant_of)):
        conv = await run(store.get_conversation, tenant, conv_id)
        parent_id = body.parent_id if "parent_id" in body.model_fields_set else conv.current_leaf_id
        if body.role == "user":
            out = await add_user_message(tenant, conv_id, conv.current_leaf_id, key_policy(request),
                                         content=body.content, parent_id=parent_id)
            await run(autotitle, tenant, conv_id, body.content)
            return out
        msg = await run(lambda: store.add_message(
            tenant, conv_id, role=body.role, content=body.content, parent_id=parent_id,
            finish_reason=body.finish_reason, stopped=body.stopped, stats=body.stats,
            context=body.context))
        return json_response(await run(lambda: json.dumps({"message": msg.to_json()}).encode()), 201)

    @api.get("/conversations/{conv_id}/messages/{msg_id}")
    async def get_message(conv_id: str, msg_id: str, tenant: str = Depends(tenant_of)):
        return json_response(await run(lambda: json.dumps(store.get_message(tenant, conv_id, msg_id)
                                                          .to_json()).encode()))

    @api.post("/conversations/{conv_id}/messages/{msg_id}/edit", status_code=201)
    async def edit_message(conv_id: str, msg_id: str, body: EditIn, request: Request,
                           tenant: str = Depends(tenant_of)):
        """An edit never changes history: it adds a sibling user message (a new branch)."""
        conv = await run(store.get_conversation, tenant, conv_id)
        original = await run(store.get_message, tenant, conv_id, msg_id)
        if original.role != "user":
            raise Invalid("only user messages are edited; regenerate a reply instead", "msg_id")
        return await add_user_message(tenant, conv_id, conv.current_leaf_id, key_policy(request),
                                      content=body.content, parent_id=original.parent_id)

    @api.get("/conversations/{conv_id}/context")
    async def get_context(conv_id: str, request: Request, leaf_id: str | None = None,
                          tenant: str = Depends(tenant_of)):
        leaf_id = leaf_id or (await run(store.get_conversation, tenant, conv_id)).current_leaf_id
        if leaf_id is None:
            raise Invalid("the conversation has no messages yet", "leaf_id")
        return await context_json(tenant, conv_id, leaf_id, key_policy(request))

    @api.put("/conversations/{conv_id}/leaf")
    async def set_leaf(conv_id: str, body: LeafIn, tenant: str = Depends(tenant_of)):
        def move() -> dict:
            leaf = store.set_leaf(tenant, conv_id, body.message_id, descend=body.descend)
            return {"current_leaf_id": leaf, "path": [m.id for m in store.path(tenant, conv_id)]}
        return await run(move)

    return api
