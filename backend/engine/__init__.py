"""The engine: sequences, scheduler, sampler, admission, LLMEngine (step API), EngineLoop (thread).

Errors it raises or reports are backend.errors.EngineError (one type, with a kind). ``LLMEngine``
and ``EngineStats`` are imported lazily, so that light users (the shim, pre/postprocessing) can
import ``backend.engine.admission`` (``SamplingParams``) without pulling in torch and the model."""
from typing import Any

from backend.engine.admission import EngineLimits

__all__ = ["EngineLimits", "EngineStats", "LLMEngine"]


def __getattr__(name: str) -> Any:
    if name in ("EngineStats", "LLMEngine"):
        from backend.engine import llm_engine
        return getattr(llm_engine, name)
    raise AttributeError(f"module 'backend.engine' has no attribute {name!r}")
