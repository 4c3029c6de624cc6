"""HTTP routes: /v1/chat/completions, /v1/completions, /v1/models, /health, /ready.

One gRPC stream per prompt of an HTTP request. Failures before the first token answer with an
error status; failures after it end the SSE stream with an ``error`` event and no ``[DONE]``.
"""
from __future__ import annotations

import logging
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from backend import protocol as P
from backend import timing
from client.errors import InternalError, TritonLLMError, UnavailableError
from client.shim.errors import from_llm_error, not_ready
from client.shim.format import Tally
from client.shim.generation import ClientDisconnected, collect, merged, until_disconnect
from client.shim.limits import check_prompt_chars
from client.shim.lora import adapter_cards, adapter_for
from client.shim.reasoning import parses_reasoning, with_reasoning
from client.shim.schemas import ChatCompletionRequest, CompletionRequest
from client.shim.settings import context_window_of
from client.shim.streaming import BoundedSSE
from client.shim.tenants import KeyPolicy, Slot, effective_priority
from client.shim.tools import ToolTally, parses_tool_calls

log = logging.getLogger("triton_llm.shim")
router = APIRouter()
CLIENT_CLOSED = 499                                 # nginx's code; the client never sees it


def _state(request: Request):
    return request.app.state


async def authenticated(request: Request) -> KeyPolicy:
    """The caller's key policy; a dependency, so a bad key is a 401 before the body is validated.
    ``async`` on purpose: FastAPI runs a plain ``def`` dependency in its thread pool, a thread
    hand-off and back on every request (~0.3 ms before the first token at 1 stream) for a few
    constant-time compares."""
    return _state(request).keys.identify(request)


def _check_model(request: Request, model: str) -> None:
    """404 unless ``model`` is the served model or one of its adapters (lora.py)."""
    adapter_for(_state(request), model)


async def _check_prompt(request: Request, chars: int, param: str) -> None:
    """A prompt far longer than the context window is a 400 before the server tokenizes it."""
    settings = _state(request).settings
    if chars <= settings.prompt_chars_per_token * 64:      # shorter than any window could reject
        return
    try:
        window = await context_window_of(request.app).get()
    except TritonLLMError:
        return                                          # the server cannot say: it checks itself
    check_prompt_chars(chars, window, settings.prompt_chars_per_token, param)


def _params(request: Request, body, key: KeyPolicy, lora: str | None = None) -> dict:
    params = body.params()
    if lora is not None:                                # the model id named an adapter (lora.py)
        params[P.LORA] = lora
    params.pop("priority", None)
    priority = effective_priority(key, body.priority)
    if priority:
        params["priority"] = priority                   # sent as request_priority
    if not _state(request).settings.allow_shared_prefix and key.tenant:
        params[P.TENANT] = key.tenant
    return params


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           key: KeyPolicy = Depends(authenticated)):
    lora = adapter_for(_state(request), body.model)
    await _check_prompt(request, body.prompt_chars(), "messages")
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    timing.mark(rid, "shim.recv")
    params = _params(request, body, key, lora)
    slot = _state(request).in_flight.acquire(key)
    client = _state(request).client
    agens = [client.generate(messages=body.messages_json(), request_id=rid, params=params,
                             stream=body.stream)]
    tally_type = ToolTally if parses_tool_calls(body) else Tally     # tools: message.tool_calls
    kw = {}
    if parses_reasoning(_state(request).settings.reasoning_parser, body):   # <think>: reasoning_content
        tally_type, kw["include_reasoning"] = with_reasoning(tally_type), body.include_reasoning
    tally = tally_type(chat=True, request_id=rid, model=body.model, num_choices=body.n or 1,
                       logprobs=bool(body.logprobs), include_usage=body.include_usage, **kw)
    return await _respond(request, agens, tally, body.n or 1, body.stream, body.param_names(), slot)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, key: KeyPolicy = Depends(authenticated)):
    lora = adapter_for(_state(request), body.model)
    await _check_prompt(request, body.prompt_chars(), "prompt")
    rid = f"cmpl-{uuid.uuid4().hex}"
    timing.mark(rid, "shim.recv")
    params = _params(request, body, key, lora)
    slot = _state(request).in_flight.acquire(key)
    client = _state(request).client
    prompts = body.prompts()
    n = body.n or 1
    agens = [client.generate(prompt=p, request_id=rid if len(prompts) == 1 else f"{rid}-{i}",
                             params=params, stream=body.stream) for i, p in enumerate(prompts)]
    tally = Tally(chat=False, request_id=rid, model=body.model, num_choices=n * len(prompts),
                  logprobs=body.logprobs is not None, include_usage=body.include_usage)
    return await _respond(request, agens, tally, n, body.stream, body.param_names(), slot)


async def _respond(request: Request, agens: list, tally: Tally, n: int, stream: bool,
                   param_names: dict[str, str], slot: Slot) -> Response:
    """Answer the request; ``slot`` (the key's open-request count) is released when it is over:
    here for a whole response, when the SSE stream closes for a stream."""
    settings = _state(request).settings
    items = merged(agens, n)
    handed_over = False
    try:
        if not stream:
            try:
                await until_disconnect(request, collect(items, tally), settings.disconnect_poll_s)
            except ClientDisconnected:
                log.info("%s: client disconnected, generation aborted", tally.id)
                return Response(status_code=CLIENT_CLOSED)
            except TritonLLMError as exc:
                raise from_llm_error(exc, param_names) from None
            if not tally.done:                          # never a 200 with a truncated answer
                raise from_llm_error(UnavailableError("the server ended the request before it finished"))
            return JSONResponse(tally.response(), headers=tally.headers())

        # Streaming: wait for the first response so that a rejection (400 / 429 / 503) still gets
        # its status code instead of a 200 stream that fails at once.
        try:
            first = await until_disconnect(request, anext(items, None), settings.disconnect_poll_s)
        except ClientDisconnected:
            log.info("%s: client disconnected before the first token, generation aborted", tally.id)
            return Response(status_code=CLIENT_CLOSED)
        except TritonLLMError as exc:
            raise from_llm_error(exc, param_names) from None
        handed_over = True
        return BoundedSSE(_events(first, items, tally, param_names), name=tally.id,
                          write_timeout=settings.stream_write_timeout_s, on_close=slot.release,
                          headers={"x-request-id": tally.id, "cache-control": "no-cache",
                                   "x-accel-buffering": "no"})
    finally:
        if not handed_over:
            slot.release()
            await items.aclose()


async def _events(first, items, tally: Tally, param_names: dict[str, str]):
    """SSE body, one write per gRPC response (its events joined; the role chunks go with the first
    one, the finish chunks with the usage and ``[DONE]``): the same bytes in fewer sends. A client
    disconnect cancels this generator mid-await; the per-stream cleanup (gRPC cancel + explicit
    abort) runs synchronously as the cancellation unwinds."""
    pending = ""
    try:
        pending = "".join(tally.start_events())
        item = first
        while item is not None:
            pending += "".join(tally.chunk_events(*item))
            if pending and not tally.done:
                yield pending
                pending = ""
            item = await anext(items, None)
        if not tally.done:
            raise UnavailableError("the server ended the request before it finished")
        pending += "".join(tally.end_events())
        yield pending
    except TritonLLMError as exc:
        log.warning("%s: stream failed after it started: %s", tally.id, exc)
        yield pending + tally.error_event(from_llm_error(exc, param_names))
    except Exception as exc:                    # noqa: BLE001 -- still end with an error event
        log.exception("%s: stream failed", tally.id)
        yield pending + tally.error_event(from_llm_error(InternalError(f"{type(exc).__name__}: {exc}")))
    finally:
        await items.aclose()


@router.get("/v1/models")
async def list_models(request: Request, _key: KeyPolicy = Depends(authenticated)):
    s = _state(request)
    return {"object": "list", "data": [await _model_card(request), *adapter_cards(s)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request, _key: KeyPolicy = Depends(authenticated)):
    s = _state(request)
    if adapter_for(s, model_id) is not None:
        return next(c for c in adapter_cards(s) if c["id"] == model_id)
    return await _model_card(request)


async def _model_card(request: Request) -> dict:
    s = _state(request)
    card = {"id": s.settings.served_model, "object": "model", "created": s.created,
            "owned_by": "triton-llm"}
    try:
        card["max_model_len"] = await context_window_of(request.app).get()
    except TritonLLMError as exc:               # the server is not up yet: the card without it
        log.info("context window unknown: %s", exc)
    card.update(await _weights_info(request))
    return card


async def _weights_info(request: Request) -> dict:
    """dtype, quantization, quant_group_size, weight_bytes of the served weights (asked once; {}
    while the server cannot say, or from a client that cannot ask)."""
    s = _state(request)
    info = getattr(s, "weights_info", None)
    if info is None:
        ask = getattr(s.client, "weights_info", None)
        if ask is None:
            return {}
        try:
            info = s.weights_info = await ask()
        except TritonLLMError as exc:
            log.info("weights unknown: %s", exc)
            return {}
    return info


@router.get("/health")
async def health():
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request):
    if await _state(request).client.is_ready():
        return {"status": "ready"}
    return not_ready("Triton or the model is not ready").response()
