"""HTTP routes: /v1/chat/completions, /v1/completions, /v1/models, /health, /ready.

Each generating route builds its tally (the API's body and stream shape) and hands the request to
the shared generation path (generation.py): one gRPC stream per prompt.
"""
from __future__ import annotations

import logging
import uuid

from fastapi import APIRouter, Depends, Request

from client.errors import TritonLLMError
from client.shim.errors import not_ready
from client.shim.format import Tally
from client.shim.generation import adapter_for, check_prompt, known, request_params, respond
from client.shim.reasoning import parses_reasoning, with_reasoning
from client.shim.schemas import ChatCompletionRequest, CompletionRequest
from client.shim.settings import context_window_of
from client.shim.tenants import KeyPolicy, authenticated
from client.shim.tools import ToolTally, parses_tool_calls

log = logging.getLogger("triton_llm.shim")
router = APIRouter()


def _state(request: Request):
    return request.app.state


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           key: KeyPolicy = Depends(authenticated)):
    lora = adapter_for(_state(request), body.model)
    await check_prompt(request, body.prompt_chars(), "messages")
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    params = request_params(request, body, key, lora)
    slot = _state(request).in_flight.acquire(key)
    client = _state(request).client
    agens = [client.generate(messages=body.messages_json(), request_id=rid, params=params,
                             stream=body.stream)]
    tally_type = ToolTally if body.tools and parses_tool_calls(body) else Tally     # tools: message.tool_calls
    kw = {}
    parser = _state(request).settings.reasoning_parser
    if parser and parses_reasoning(parser, body):       # <think>: reasoning_content
        tally_type, kw["include_reasoning"] = with_reasoning(tally_type), body.include_reasoning
    tally = tally_type(chat=True, request_id=rid, model=body.model, num_choices=body.n or 1,
                       logprobs=bool(body.logprobs), include_usage=body.include_usage, **kw)
    return await respond(request, agens, tally, body.n or 1, body.stream, body.param_names(), slot)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, key: KeyPolicy = Depends(authenticated)):
    lora = adapter_for(_state(request), body.model)
    await check_prompt(request, body.prompt_chars(), "prompt")
    rid = f"cmpl-{uuid.uuid4().hex}"
    params = request_params(request, body, key, lora)
    slot = _state(request).in_flight.acquire(key)
    client = _state(request).client
    prompts = body.prompts()
    n = body.n or 1
    agens = [client.generate(prompt=p, request_id=rid if len(prompts) == 1 else f"{rid}-{i}",
                             params=params, stream=body.stream) for i, p in enumerate(prompts)]
    tally = Tally(chat=False, request_id=rid, model=body.model, num_choices=n * len(prompts),
                  logprobs=body.logprobs is not None, include_usage=body.include_usage)
    return await respond(request, agens, tally, n, body.stream, body.param_names(), slot)


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


def adapter_cards(state) -> list[dict]:
    """vLLM's shape: one model card per LoRA adapter, ``parent`` = the base model's id."""
    return [{"id": name, "object": "model", "created": state.created, "owned_by": "triton-llm",
             "parent": state.settings.served_model, "root": name} for name in known(state)]


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
