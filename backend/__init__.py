"""LLM serving backend: engine, paged KV cache, model, offline API.

``LLM`` is imported lazily so that light users (the shim, pre/postprocessing) can import
``backend.sampling_params`` without pulling in torch and the model.
"""
from backend.config import EngineArgs
from backend.sampling_params import SamplingParams

__all__ = ["LLM", "EngineArgs", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from backend.llm import LLM
        return LLM
    raise AttributeError(f"module 'backend' has no attribute {name!r}")
