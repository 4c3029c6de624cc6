"""The engine: sequences, scheduler, sampler, stop checks, LLMEngine (step API), EngineLoop (thread)."""
from backend.engine.errors import QueueFullError
from backend.engine.llm_engine import LLMEngine
from backend.engine.stats import EngineStats

__all__ = ["EngineStats", "LLMEngine", "QueueFullError"]
