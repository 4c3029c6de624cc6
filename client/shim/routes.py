"""HTTP routes: /v1/chat/completions, /v1/completions, /v1/models, /health, /ready.

One gRPC stream per prompt of an HTTP request. Failures before the first token answer with an
error status; failures after it end the SSE stream with an ``error`` event and no ``[DONE]``.
"""
from __future__ import annotations

import logging
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from client.errors import InternalError, TritonLLMError, UnavailableError
from client.shim.errors import from_llm_error, model_not_found, not_ready
from client.shim.format import Tally
from client.shim.generation import ClientDisconnected, collect, merged, until_disconnect
from client.shim.schemas import ChatCompletionRequest, CompletionRequest
from client.shim.settings import context_window_of

log = logging.getLogger("triton_llm.shim")
router = APIRouter()
CLIENT_CLOSED = 499                                 # nginx's code; the client never sees it


def _state(request: Request):
    return request.app.state


def authenticated(request: Request) -> str:
    """The caller's tenant; a dependency, so a bad key is a 401 before the body is validated."""
    return _state(request).authenticate(request)


def _check_model(request: Request, model: str) -> None:
    if model != _state(request).settings.served_model:
        raise model_not_found(model)


def _with_tenant(request: Request, params: dict, tenant: str) -> dict:
    if not _state(request).settings.allow_shared_prefix and tenant:
        params["tenant"] = tenant
    return params


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           tenant: str = Depends(authenticated)):
    _check_model(request, body.model)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    params = _with_tenant(request, body.params(), tenant)
    client = _state(request).client
    agens = [client.generate(messages=body.messages_json(), request_id=rid, params=params,
                             stream=body.stream)]
    tally = Tally(chat=True, request_id=rid, model=body.model, num_choices=body.n or 1,
                  logprobs=bool(body.logprobs), include_usage=body.include_usage)
    return await _respond(request, agens, tally, body.n or 1, body.stream, body.param_names())


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, tenant: str = Depends(authenticated)):
    _check_model(request, body.model)
    rid = f"cmpl-{uuid.uuid4().hex}"
    params = _with_tenant(request, body.params(), tenant)
    client = _state(request).client
    prompts = body.prompts()
    n = body.n or 1
    agens = [client.generate(prompt=p, request_id=rid if len(prompts) == 1 else f"{rid}-{i}",
                             params=params, stream=body.stream) for i, p in enumerate(prompts)]
    tally = Tally(chat=False, request_id=rid, model=body.model, num_choices=n * len(prompts),
                  logprobs=body.logprobs is not None, include_usage=body.include_usage)
    return await _respond(request, agens, tally, n, body.stream, body.param_names())


async def _respond(request: Request, agens: list, tally: Tally, n: int, stream: bool,
                   param_names: dict[str, str]) -> Response:
    poll = _state(request).settings.disconnect_poll_s
    items = merged(agens, n)
    if not stream:
        try:
            await until_disconnect(request, collect(items, tally), poll)
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
        first = await until_disconnect(request, anext(items, None), poll)
    except ClientDisconnected:
        log.info("%s: client disconnected before the first token, generation aborted", tally.id)
        return Response(status_code=CLIENT_CLOSED)
    except TritonLLMError as exc:
        raise from_llm_error(exc, param_names) from None
    return StreamingResponse(_events(first, items, tally, param_names), media_type="text/event-stream",
                             headers={"x-request-id": tally.id, "cache-control": "no-cache",
                                      "x-accel-buffering": "no"})


async def _events(first, items, tally: Tally, param_names: dict[str, str]):
    """SSE body. A client disconnect cancels this generator mid-await; the per-stream cleanup
    (gRPC cancel + explicit abort) runs synchronously as the cancellation unwinds."""
    try:
        for ev in tally.start_events():
            yield ev
        item = first
        while item is not None:
            for ev in tally.chunk_events(*item):
                yield ev
            item = await anext(items, None)
        if not tally.done:
            raise UnavailableError("the server ended the request before it finished")
        for ev in tally.end_events():
            yield ev
    except TritonLLMError as exc:
        log.warning("%s: stream failed after it started: %s", tally.id, exc)
        yield from_llm_error(exc, param_names).sse()
    except Exception as exc:                    # noqa: BLE001 -- still end with an error event
        log.exception("%s: stream failed", tally.id)
        yield from_llm_error(InternalError(f"{type(exc).__name__}: {exc}")).sse()
    finally:
        await items.aclose()


@router.get("/v1/models")
async def list_models(request: Request, _tenant: str = Depends(authenticated)):
    return {"object": "list", "data": [await _model_card(request)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request, _tenant: str = Depends(authenticated)):
    _check_model(request, model_id)
    return await _model_card(request)


async def _model_card(request: Request) -> dict:
    s = _state(request)
    card = {"id": s.settings.served_model, "object": "model", "created": s.created,
            "owned_by": "triton-llm"}
    try:
        card["max_model_len"] = await context_window_of(request.app).get()
    except TritonLLMError as exc:               # the server is not up yet: the card without it
        log.info("context window unknown: %s", exc)
    return card


@router.get("/health")
async def health():
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request):
    if await _state(request).client.is_ready():
        return {"status": "ready"}
    return not_ready("Triton or the model is not ready").response()
