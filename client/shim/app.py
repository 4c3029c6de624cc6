"""``create_app(settings, client=None)``: the OpenAI-compatible FastAPI app.

``client`` is anything with TritonLLMClient's ``generate`` / ``is_ready`` / ``close``; tests inject
a fake. The app also offers, on ``app.state``, what the chat page (``client.chat``) builds on:

    app.state.authenticate(request) -> tenant           raises the 401 OpenAIError
    await app.state.complete(messages, max_tokens=, tenant=) -> str   non-streaming chat answer
    app.state.client, app.state.settings
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid

from fastapi import FastAPI

from client.errors import TritonLLMError
from client.interface import LLMClient
from client.shim.anthropic import router as anthropic_router
from client.shim.embeddings import router as embeddings_router
from client.shim.errors import from_llm_error, install_handlers
from client.shim.format import Tally
from client.shim.generation import collect, merged
from client.shim.generation import router as generation_router
from client.shim.limits import BodyLimit
from client.shim.lora_routes import router as lora_router
from client.shim.response_store import ResponseStore
from client.shim.responses import router as responses_router
from client.shim.routes import router
from client.shim.settings import ShimSettings, load_keys
from client.shim.tenants import InFlight, KeyFirst, KeyStore

log = logging.getLogger("triton_llm.shim")


def create_app(settings: ShimSettings | None = None, *, client: LLMClient | None = None) -> FastAPI:
    settings = settings or ShimSettings()
    if not settings.model_name:                 # the chat page reads settings.model_name
        settings = dataclasses.replace(settings, model_name=settings.served_model)
    keys = KeyStore(load_keys(settings))
    if client is None and settings.triton_grpc_decode:   # prefill/decode disaggregation
        from client.disagg_client import DisaggLLMClient

        client = DisaggLLMClient(settings.triton_grpc, settings.triton_grpc_decode, ensemble=settings.ensemble,
                                 engine=settings.engine)
    if client is None:
        from client.triton_client import TritonLLMClient

        client = TritonLLMClient(settings.triton_grpc, ensemble=settings.ensemble, engine=settings.engine)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        if keys.open:
            log.warning("no API keys configured (--api-keys / TRITON_LLM_API_KEYS): the API is open "
                        "to anyone who can reach it")
        log.info("serving model %r from Triton at %s", settings.served_model, settings.triton_grpc)
        try:
            yield
        finally:
            await client.close()

    app = FastAPI(title="triton-llm OpenAI-compatible API", lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.settings = settings
    app.state.client = client
    app.state.keys = keys
    app.state.in_flight = InFlight()            # open generation requests per key (max_concurrent)
    app.state.created = int(time.time())
    app.state.authenticate = keys.authenticate

    async def complete(messages: list[dict], *, max_tokens: int, tenant: str,
                       temperature: float = 0.0, priority: int = 0) -> str:
        """A non-streaming chat completion's text (the chat page summarizes old turns with it, at
        the key's priority ceiling)."""
        params: dict = {"max_tokens": max_tokens, "temperature": temperature}
        if priority:
            params["priority"] = priority
        if tenant and not settings.allow_shared_prefix:
            params["tenant"] = tenant
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        tally = Tally(chat=True, request_id=rid, model=settings.served_model, num_choices=1, logprobs=False)
        try:
            await collect(merged([client.generate(messages=messages, request_id=rid, params=params,
                                                  stream=False)], 1), tally)
        except TritonLLMError as exc:
            raise from_llm_error(exc) from None
        return tally.response()["choices"][0]["message"]["content"]

    app.state.complete = complete
    install_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes,   # 413 before parsing
                       timeout=settings.body_timeout_s)
    app.add_middleware(KeyFirst, keys=keys)            # 401 before the body is read (outside BodyLimit)
    app.include_router(generation_router)             # /v1/chat/completions, /v1/completions
    app.include_router(router)                        # /v1/models, /health, /ready
    app.include_router(embeddings_router)             # /v1/embeddings
    app.include_router(lora_router)                   # /v1/load_lora_adapter, /v1/unload_lora_adapter
    app.state.response_store = ResponseStore(settings.response_store_items, settings.response_store_bytes)
    app.include_router(responses_router)                  # /v1/responses
    app.include_router(anthropic_router)                  # /v1/messages (errors in its shape: errors.py)
    try:
        import client.chat as chat_page
    except ImportError as exc:
        if exc.name != "client.chat":
            log.warning("chat page not mounted: %s", exc)
        chat_page = None
    if chat_page is not None and hasattr(chat_page, "mount_chat"):
        chat_page.mount_chat(app, settings)
    return app
