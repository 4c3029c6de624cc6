"""The OpenAI generating routes (/v1/chat/completions, /v1/completions) and the one generation path
they share with Responses and Anthropic Messages: from a validated body to its answer.

    check_prompt ─► request_params (key's priority, tenant, adapter) ─► InFlight slot ─► gRPC
    stream(s) (client.generate) ─► merged ─► respond: a whole body (collect) or an SSE stream
    (events, BoundedSSE) ─► the API's tally shapes each chunk; errors mapped by the API's own
    param names

A completions request may carry several prompts; each is its own gRPC stream and its choices are
numbered ``prompt_index * n + index``. Failures before the first token answer with an error
status; failures after it end the SSE stream with an ``error`` event and no ``[DONE]``. Every
cleanup path here is synchronous (it only cancels tasks / closes generators whose own cleanup
does not await), so it works inside a task that the server already cancelled because the HTTP
client went away.

A request's ``model`` names the served base model or one of its LoRA adapters (docs/lora.md):
``adapter_for`` resolves it. The adapter ids start as ``ShimSettings.lora_names`` (``triton-llm
serve --lora NAME=DIR``) and change with the admin routes (lora_routes.py); the engine resolves
the name (request parameter ``lora``) and refuses one it does not hold.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from backend import protocol as P
from client.errors import InternalError, TritonLLMError, UnavailableError
from client.shim.errors import from_llm_error, model_not_found
from client.shim.format import Tally
from client.shim.limits import BoundedSSE, check_prompt_chars
from client.shim.reasoning import parses_reasoning, with_reasoning
from client.shim.schemas import ChatCompletionRequest, CompletionRequest
from client.shim.settings import context_window_of
from client.shim.tenants import KeyPolicy, Slot, authenticated, effective_priority
from client.shim.tools import ToolTally, parses_tool_calls
from client.wire import Chunk

log = logging.getLogger("triton_llm.shim")
Item = tuple[int, int, Chunk]                    # (choice index, prompt index, chunk)
QUEUE_ITEMS = 64                                 # chunks merged from several prompts, waiting
CLIENT_CLOSED = 499                              # nginx's code; the client never sees it
router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           key: KeyPolicy = Depends(authenticated)):
    state, params, slot = await admit(request, body, key, "messages")
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    agens = [state.client.generate(messages=body.messages_json(), request_id=rid, params=params,
                                   stream=body.stream)]
    tally_type = ToolTally if body.tools and parses_tool_calls(body) else Tally     # tools: message.tool_calls
    kw = {}
    parser = state.settings.reasoning_parser
    if parser and parses_reasoning(parser, body):       # <think>: reasoning_content
        tally_type, kw["include_reasoning"] = with_reasoning(tally_type), body.include_reasoning
    tally = tally_type(chat=True, request_id=rid, model=body.model, num_choices=body.n or 1,
                       logprobs=bool(body.logprobs), include_usage=body.include_usage, **kw)
    return await respond(request, agens, tally, body.n or 1, body.stream, body.param_names(), slot)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, key: KeyPolicy = Depends(authenticated)):
    state, params, slot = await admit(request, body, key, "prompt")
    rid = f"cmpl-{uuid.uuid4().hex}"
    prompts = body.prompts()
    n = body.n or 1
    agens = [state.client.generate(prompt=p, request_id=rid if len(prompts) == 1 else f"{rid}-{i}",
                                   params=params, stream=body.stream) for i, p in enumerate(prompts)]
    tally = Tally(chat=False, request_id=rid, model=body.model, num_choices=n * len(prompts),
                  logprobs=body.logprobs is not None, include_usage=body.include_usage)
    return await respond(request, agens, tally, n, body.stream, body.param_names(), slot)


class ClientDisconnected(Exception):
    """The HTTP client closed the connection; the generation was cancelled and aborted."""


async def check_prompt(request: Request, chars: int, param: str) -> None:
    """A prompt far longer than the context window is a 400 before the server tokenizes it."""
    settings = request.app.state.settings
    if chars <= settings.prompt_chars_per_token * 64:      # shorter than any window could reject
        return
    try:
        window = await context_window_of(request.app).get()
    except TritonLLMError:
        return                                          # the server cannot say: it checks itself
    check_prompt_chars(chars, window, settings.prompt_chars_per_token, param)


def known(state) -> dict[str, None]:
    """The app's adapter ids in registration order (an ordered set, on ``app.state``)."""
    names = getattr(state, "lora_names", None)
    if names is None:
        names = state.lora_names = dict.fromkeys(state.settings.lora_names)
    return names


def adapter_for(state, model: str) -> str | None:
    """None for the base model, the adapter's name for an adapter id; 404 for anything else."""
    if model == state.settings.served_model:
        return None
    if model in known(state):
        return model
    raise model_not_found(model)


def request_params(request: Request, body, key: KeyPolicy, lora: str | None = None) -> dict:
    """The body's parameters plus the adapter its model names, the key's priority and tenant."""
    params = body.params()
    if lora is not None:                                # the model id named an adapter (adapter_for)
        params[P.LORA] = lora
    params.pop("priority", None)
    priority = effective_priority(key, body.priority)
    if priority:
        params["priority"] = priority                   # sent as request_priority
    if not request.app.state.settings.allow_shared_prefix and key.tenant:
        params[P.TENANT] = key.tenant
    return params


async def admit(request: Request, body, key: KeyPolicy, prompt_param: str) -> tuple:
    """What every generating route does first: the model id -> adapter (404), the prompt's size
    (400), the parameters with the key's, and the key's slot (429); -> (app state, params, slot)."""
    state = request.app.state
    lora = adapter_for(state, body.model)
    await check_prompt(request, body.prompt_chars(), prompt_param)
    params = request_params(request, body, key, lora)
    return state, params, state.in_flight.acquire(key)


async def respond_chat(request: Request, key: KeyPolicy, chat, tally, param_names: dict[str, str],
                       prompt_param: str) -> Response:
    """Generate the ChatCompletionRequest ``chat`` (Responses and Anthropic Messages translate their
    bodies into one) and answer with ``tally``'s shape (a whole body, or its SSE stream)."""
    state, params, slot = await admit(request, chat, key, prompt_param)
    agens = [state.client.generate(messages=chat.messages_json(), request_id=tally.id, params=params,
                                   stream=chat.stream)]
    return await respond(request, agens, tally, 1, chat.stream, param_names, slot)


async def respond(request: Request, agens: list, tally: Tally, n: int, stream: bool,
                  param_names: dict[str, str], slot: Slot) -> Response:
    """Answer the request; ``slot`` (the key's open-request count) is released when it is over:
    here for a whole response, when the SSE stream closes for a stream."""
    settings = request.app.state.settings
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
        return BoundedSSE(events(first, items, tally, param_names), name=tally.id,
                          write_timeout=settings.stream_write_timeout_s, on_close=slot.release,
                          headers={"x-request-id": tally.id, "cache-control": "no-cache",
                                   "x-accel-buffering": "no"})
    finally:
        if not handed_over:
            slot.release()
            await items.aclose()


async def events(first, items, tally: Tally, param_names: dict[str, str]):
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


async def _single(agen: AsyncIterator[Chunk]) -> AsyncIterator[Item]:
    try:
        async for chunk in agen:
            yield chunk.index, 0, chunk
    finally:
        await agen.aclose()                      # already finished when we got here by an exception


async def merged(agens: list[AsyncIterator[Chunk]], n: int) -> AsyncIterator[Item]:
    """Interleave several prompts' streams as they produce; the first error stops them all."""
    if len(agens) == 1:
        async for item in _single(agens[0]):
            yield item
        return
    # Bounded: a consumer that stops pulling (a slow SSE client) stops the pumps too, so what
    # waits here is at most QUEUE_ITEMS chunks, and the rest stays in the gRPC streams.
    queue: asyncio.Queue = asyncio.Queue(maxsize=QUEUE_ITEMS)
    _END = object()

    async def pump(pi: int, agen: AsyncIterator[Chunk]) -> None:
        try:
            async for chunk in agen:
                await queue.put((pi * n + chunk.index, pi, chunk))
            await queue.put(_END)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:             # noqa: BLE001 -- re-raised by the consumer
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(pi, g)) for pi, g in enumerate(agens)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()                           # each stream's own cleanup cancels + aborts


async def until_disconnect(request: Request | None, awaitable, poll_s: float = 0.1):
    """Await ``awaitable``; if the HTTP client disconnects first, cancel it and raise
    ClientDisconnected (uvicorn does not cancel a plain handler when its client leaves)."""
    task = asyncio.ensure_future(awaitable)
    if request is None:
        return await task
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                raise ClientDisconnected()
    except asyncio.CancelledError:
        # the handler itself was cancelled (Ray Serve does so when a client hangs up): let the
        # inner task finish its cleanup before the caller's ``finally`` closes what it iterates
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise


async def collect(items: AsyncIterator[Item], tally) -> None:
    async for index, prompt_index, chunk in items:
        tally.add(index, prompt_index, chunk)
