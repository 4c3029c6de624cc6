"""HTTP routes that generate nothing: /v1/models, /health, /ready. The generating ones live with
the path they share: /v1/chat/completions and /v1/completions in generation.py, Responses in
responses.py, Anthropic Messages in anthropic.py, embeddings in embeddings.py.
"""
from __future__ import annotations

import logging

from fastapi import APIRouter, Depends, Request

from client.errors import TritonLLMError
from client.shim.errors import not_ready
from client.shim.generation import adapter_for, known
from client.shim.settings import context_window_of
from client.shim.tenants import KeyPolicy, authenticated

log = logging.getLogger("triton_llm.shim")
router = APIRouter()


def _state(request: Request):
    return request.app.state


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
