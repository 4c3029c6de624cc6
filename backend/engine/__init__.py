"""The engine: sequences, scheduler, sampler, stop checks, LLMEngine (step API), EngineLoop (thread).

Errors it raises or reports are backend.errors.EngineError (one type, with a kind)."""
from backend.engine.admission import EngineLimits
from backend.engine.llm_engine import EngineStats, LLMEngine

__all__ = ["EngineLimits", "EngineStats", "LLMEngine"]
