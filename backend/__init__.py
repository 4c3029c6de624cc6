"""LLM serving backend: engine, paged KV cache, model, offline API.

``LLM`` is imported lazily so that light users (the shim, pre/postprocessing) can import
``SamplingParams`` (backend/engine/admission.py) without pulling in torch and the model.
"""
from backend.config import EngineArgs
from backend.engine.admission import SamplingParams

__all__ = ["LLM", "EngineArgs", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from backend.llm import LLM
        return LLM
    raise AttributeError(f"module 'backend' has no attribute {name!r}")
