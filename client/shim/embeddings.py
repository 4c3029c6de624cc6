"""``POST /v1/embeddings``: OpenAI's embeddings API over the engine's embedding requests.

    input: "text" | ["text", ...] | [token ids] | [[token ids], ...]
        ──► one engine request per input (text tokenized by the ``preprocessing`` model first;
            TritonLLMClient.embed), at most CONCURRENCY of them open at once
        ──► {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "usage"}

``encoding_format`` "float" (a JSON list) or "base64" (little-endian float32 bytes, what the
official SDK asks for by default and decodes). ``dimensions`` only for a model whose config declares
Matryoshka support (the engine checks; otherwise a 400 naming ``dimensions``). Pooling and
normalization are the model's (backend/model/pooling.py); vLLM's ``normalize`` extra is honoured.
If one input fails, the others are aborted and the request gets that input's error.
"""
from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from backend import protocol as P
from client.errors import TritonLLMError
from client.interface import EmbeddingClient
from client.shim import limits as L
from client.shim.errors import OpenAIError, from_llm_error, model_not_found
from client.shim.generation import ClientDisconnected, until_disconnect
from client.shim.tenants import KeyPolicy, authenticated

router = APIRouter()
MAX_INPUTS = 2048              # OpenAI's limit on inputs in one request
CONCURRENCY = 32               # inputs of one request open in the engine at once (its waiting queue is bounded)
CLIENT_CLOSED = 499
PARAM_NAMES = {P.TEXT_INPUT: "input", P.INPUT_IDS: "input"}

SHAPES = ("a non-empty string, a list of non-empty strings, a list of token ids (integers >= 0), or a "
          f"list of such lists, with at most {MAX_INPUTS} items")


def _is_tokens(x) -> bool:
    return (isinstance(x, list) and len(x) > 0 and
            all(type(t) is int and 0 <= t <= L.INT32_MAX for t in x))


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[StrictInt, Field(ge=1, le=L.INT32_MAX)] | None = None
    normalize: bool | None = None              # vLLM's extension
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _shape(cls, x):
        """The four shapes OpenAI accepts; anything else (empty, mixed, bools, floats) is a 400."""
        if isinstance(x, str) and x:
            return x
        if _is_tokens(x):
            return x
        if isinstance(x, list) and 0 < len(x) <= MAX_INPUTS and (
                all(isinstance(i, str) and i for i in x) or all(_is_tokens(i) for i in x)):
            return x
        raise ValueError(f"input must be {SHAPES}")

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        return [x] if isinstance(x, str) or isinstance(x[0], int) else list(x)


def encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request, key: KeyPolicy = Depends(authenticated)):
    state = request.app.state
    if body.model != state.settings.served_model:
        raise model_not_found(body.model)
    params: dict = {P.DIMENSIONS: body.dimensions, P.NORMALIZE: body.normalize}
    if not state.settings.allow_shared_prefix and key.tenant:
        params[P.TENANT] = key.tenant               # prefix-cache reads stay within the tenant
    if not hasattr(state.client, "embed"):       # e.g. the prefill/decode pair's client
        raise OpenAIError(501, "This deployment does not serve embeddings.", "invalid_request_error", None,
                          "not_implemented")
    rid = f"embd-{uuid.uuid4().hex}"
    slot = state.in_flight.acquire(key)
    try:
        results = await until_disconnect(request, _embed_all(state.client, body.inputs(), params, rid),
                                         state.settings.disconnect_poll_s)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    except TritonLLMError as exc:
        raise from_llm_error(exc, PARAM_NAMES) from None
    finally:
        slot.release()
    tokens = sum(n for _, n in results)
    data = [{"object": "embedding", "index": i, "embedding": encode(vec, body.encoding_format)}
            for i, (vec, _) in enumerate(results)]
    return JSONResponse({"object": "list", "data": data, "model": body.model,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def _embed_all(client: EmbeddingClient, inputs: list, params: dict, rid: str) -> list[tuple[list[float], int]]:
    """Every input's (vector, tokens) in order; the first failure cancels the rest (each cancelled
    request is aborted in the engine by the client) and is raised."""
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int, item):
        async with gate:
            kw = {"text": item} if isinstance(item, str) else {"input_ids": item}
            return await client.embed(**kw, params=params, request_id=rid if len(inputs) == 1 else f"{rid}-{i}")

    tasks = [asyncio.ensure_future(one(i, item)) for i, item in enumerate(inputs)]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
