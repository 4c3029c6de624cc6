"""Admin routes for LoRA adapters, in vLLM's shape (docs/lora.md):

    POST /v1/load_lora_adapter    {"lora_name": "...", "lora_path": "/dir"}
    POST /v1/unload_lora_adapter  {"lora_name": "..."}

Only a key with ``admin=1`` (client/shim/tenants.py) may call them; a shim without keys refuses
them. The engine validates and loads the adapter (a ``lora_admin`` control request,
client/lora_admin.py); a bad adapter is a 400 naming the file and field, an unknown name a 404.
"""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from client.errors import TritonLLMError
from client.lora_admin import lora_admin
from client.shim.errors import OpenAIError, from_llm_error, model_not_found
from client.shim.generation import known
from client.shim.tenants import KeyPolicy, authenticated

router = APIRouter()


class LoadLoRA(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRA(BaseModel):
    model_config = ConfigDict(extra="ignore")           # vLLM's clients may send lora_int_id
    lora_name: str = Field(min_length=1, max_length=128)


def _admin(key: KeyPolicy) -> None:
    if not key.admin:
        raise OpenAIError(403, "This API key may not manage LoRA adapters (give it admin=1 in the keys file).",
                          "permission_error", None, "insufficient_permissions")


async def _engine(request: Request, action: str, name: str, path: str | None = None) -> None:
    try:
        await lora_admin(request.app.state.client, action, name, path)
    except TritonLLMError as exc:
        raise from_llm_error(exc) from None


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRA, request: Request, key: KeyPolicy = Depends(authenticated)):
    _admin(key)
    names = known(request.app.state)
    if body.lora_name in names or body.lora_name == request.app.state.settings.served_model:
        raise OpenAIError(400, f"The model id '{body.lora_name}' is already in use.", "invalid_request_error",
                          "lora_name", "model_exists")
    await _engine(request, "load", body.lora_name, body.lora_path)
    names[body.lora_name] = None
    return {"object": "lora_adapter", "id": body.lora_name, "status": "loaded"}


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRA, request: Request, key: KeyPolicy = Depends(authenticated)):
    _admin(key)
    names = known(request.app.state)
    if body.lora_name not in names:
        raise model_not_found(body.lora_name)
    names.pop(body.lora_name)                  # new requests naming it are 404s from now on
    await _engine(request, "unload", body.lora_name)
    return {"object": "lora_adapter", "id": body.lora_name, "status": "unloaded"}
