"""LoRA adapters in the OpenAI API (docs/lora.md): a request's ``model`` names the served base
model or one of its adapters; ``/v1/models`` lists both, each adapter with its ``parent``.

The adapter ids start as ``ShimSettings.lora_names`` (``triton-llm serve --lora NAME=DIR``) and
change with the admin routes (lora_routes.py); the engine resolves the name (request parameter
``lora``) and refuses one it does not hold.
"""
from __future__ import annotations

from client.shim.errors import model_not_found


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


def adapter_cards(state) -> list[dict]:
    """vLLM's shape: one model card per adapter, ``parent`` = the base model's id."""
    return [{"id": name, "object": "model", "created": state.created, "owned_by": "triton-llm",
             "parent": state.settings.served_model, "root": name} for name in known(state)]
