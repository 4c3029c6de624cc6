"""The chat web page and its session store, mounted into the OpenAI shim's FastAPI app.

    mount_chat(app, settings)
        GET  /                  the page (static/index.html)
        GET  /static/chat/...   its script and style
        /api/...                the REST API (client/chat/router.py, docs/chat.md)

The page streams replies from the shim's own ``POST /v1/chat/completions``. What it needs from
the app: ``app.state.authenticate(request) -> tenant`` and, for the summarize policy,
``app.state.complete(messages, *, max_tokens, tenant[, priority]) -> str``, and the context window
from ``client.shim.settings.context_window_of(app)`` (``max_model_len`` if set, else the server's
own). Where the app has the shim's key store (``app.state.keys``) and open-request counter
(``app.state.in_flight``), a summary's model call holds one of the key's ``max_concurrent`` slots
(429 when none is free) and runs at the key's priority ceiling, like any generation.
Settings read (all optional): ``chat_db_path``, ``max_model_len``, ``model_name``, ``model_dir``,
``chat_keep_turns``, ``chat_max_conversations`` and ``chat_max_bytes`` (per-tenant quotas,
client/chat/quota.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import pathlib

from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

from client.chat.context import ContextBuilder, TokenCounter
from client.chat.router import build_router, install_error_handlers
from client.chat.quota import DEFAULT_MAX_BYTES, DEFAULT_MAX_CONVERSATIONS, TenantQuota
from client.chat.store import ChatStore
from client.errors import TritonLLMError
from client.shim.errors import from_llm_error
from client.shim.settings import context_window_of

STATIC = pathlib.Path(__file__).resolve().parent / "static"
log = logging.getLogger(__name__)

__all__ = ["mount_chat", "ChatStore", "ContextBuilder", "TokenCounter"]


def mount_chat(app, settings=None) -> ChatStore:
    """Add the page, its static files and /api/... to ``app``; returns the store."""
    db_path = getattr(settings, "chat_db_path", None) or ":memory:"
    if db_path == ":memory:":
        log.warning("chat sessions are kept in memory only (set chat_db_path to persist them)")
    else:
        pathlib.Path(db_path).parent.mkdir(parents=True, exist_ok=True)
    quota = TenantQuota(
        max_conversations=int(getattr(settings, "chat_max_conversations", None) or DEFAULT_MAX_CONVERSATIONS),
        max_bytes=int(getattr(settings, "chat_max_bytes", None) or DEFAULT_MAX_BYTES))
    store = ChatStore(str(db_path), quota)
    model_dir = getattr(settings, "model_dir", None)

    async def complete(messages, *, max_tokens, tenant, policy=None):
        # Looked up per call: the shim may set app.state.complete after mounting the chat.
        in_flight = getattr(app.state, "in_flight", None)
        if policy is None or in_flight is None:
            return await app.state.complete(messages, max_tokens=max_tokens, tenant=tenant)
        slot = in_flight.acquire(policy)            # the key's max_concurrent: 429 when it is full
        try:
            return await app.state.complete(messages, max_tokens=max_tokens, tenant=tenant,
                                            priority=policy.priority)
        finally:
            slot.release()

    async def window() -> int:
        """The engine's context window (asked once; a 503 while the server cannot say)."""
        try:
            return await context_window_of(app, settings).get()
        except TritonLLMError as exc:
            raise from_llm_error(exc) from None

    lock, built, counters = asyncio.Lock(), [], []

    async def builder() -> ContextBuilder:
        async with lock:    # without the app's startup (a bare ASGI call): loaded on first use, once
            if not built:
                max_model_len = await window()
                if not counters:
                    counters.append(await asyncio.to_thread(TokenCounter, str(model_dir) if model_dir else None))
                built.append(ContextBuilder(store, counters[0], max_model_len, complete))
        return built[0]

    preload_at_startup(app, counters, model_dir)

    config = {"model": getattr(settings, "model_name", None), "default_policy": "truncate",
              "default_keep_turns": int(getattr(settings, "chat_keep_turns", None) or 8)}
    app.state.chat_store = store
    install_error_handlers(app)
    app.include_router(build_router(store, builder, config, window))
    app.mount("/static/chat", StaticFiles(directory=STATIC), name="chat-static")

    @app.get("/", include_in_schema=False)
    async def index():
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    return store


def preload_at_startup(app, counters: list, model_dir) -> None:
    """Do in the app's startup, before it serves, what a tenant's first chat requests would
    otherwise do on the shim's event loop, stalling every other request there:
    - load the token counter (parsing tokenizer.json holds the GIL ~0.1 s);
    - route one request into /api (FastAPI builds a router's route state, its dependants and
      validators, on the first request that reaches it: ~25-40 ms), and start the thread pool the
      routes hand SQLite to (its first use imports anyio's backend);
    then freeze what the process holds: the ~100k objects of the imports made each full GC pass
    tens of ms of stalled loop, which ``gc.freeze`` takes out of every later pass."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a):
        try:
            counters.append(await asyncio.to_thread(TokenCounter, str(model_dir) if model_dir else None))
        except Exception as exc:                      # noqa: BLE001 -- the first chat message says it
            log.warning("chat token counter not loaded at startup: %s", exc)
        try:
            await route_once(a, "/api/conversations")
            await run_in_threadpool(bool)
        except Exception as exc:                      # noqa: BLE001 -- the first request does it then
            log.warning("chat routes not prepared at startup: %s", exc)
        gc.collect()
        gc.freeze()
        async with inner(a) as state:
            yield state

    app.router.lifespan_context = lifespan


async def route_once(app, path: str) -> int:
    """Send ``OPTIONS path`` through ``app`` in process and return its status. No route answers
    OPTIONS, so the router matches every route it holds and answers 405: its route state gets
    built, and no endpoint, dependency or key check runs."""
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "OPTIONS",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [], "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    await app(scope, receive, send)
    return next((m["status"] for m in sent if m["type"] == "http.response.start"), 0)
