"""LoRA adapters in the OpenAI API (docs/lora.md): a request's ``model`` names the served base
model or one of its adapters; ``/v1/models`` lists both, each adapter with its ``parent``.

The adapter ids come from ``ShimSettings.lora_names`` (``triton-llm serve --lora NAME=DIR``); the
engine resolves the name (request parameter ``lora``) and refuses one it does not hold.
"""
from __future__ import annotations

from client.shim.errors import model_not_found


def adapter_for(settings, model: str) -> str | None:
    """None for the base model, the adapter's name for an adapter id; 404 for anything else."""
    if model == settings.served_model:
        return None
    if model in settings.lora_names:
        return model
    raise model_not_found(model)


def adapter_cards(settings, created: int) -> list[dict]:
    """vLLM's shape: one model card per adapter, ``parent`` = the base model's id."""
    return [{"id": name, "object": "model", "created": created, "owned_by": "triton-llm",
             "parent": settings.served_model, "root": name} for name in settings.lora_names]
