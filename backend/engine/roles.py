"""What EngineLoop needs from the engine it drives, and what a role's loop adds: two Protocols.

EngineLoop drives an ``LLMEngine`` or a disaggregation role's wrapper of one (PrefillEngine,
DecodeEngine: backend/serving/disagg_engine.py), which nothing declares as a subclass. Naming the
members here makes that contract checkable: mypy checks EngineLoop against ``StepEngine``, and
tests/unit/test_engine_roles.py checks every engine against it.

``HandoverLoop`` is a loop whose ``submit`` also takes a hand-over record (role=decode's
DecodeLoop). Intake (backend/serving/engine_service.py) asks ``isinstance(loop, HandoverLoop)`` before it
passes a request's ``handover`` parameter on; any other loop answers such a request with a 400.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from backend.engine.admission import EngineLimits
    from backend.engine.scheduler import Scheduler
    from backend.engine.llm_engine import EngineStats
    from backend.errors import EngineError
    from backend.kv_cache.manager import KVCacheManager
    from backend.model.pooling import PoolingConfig
    from backend.outputs import StepDelta
    from backend.pooling_params import PoolingParams
    from backend.engine.admission import SamplingParams


@runtime_checkable
class StepEngine(Protocol):
    """The engine as EngineLoop uses it, only ever from the loop's own thread (``limits`` and
    ``pooling_config`` are fixed at startup, so submit() reads them from any thread)."""
    scheduler: Scheduler
    kv: KVCacheManager
    limits: EngineLimits
    pooling_config: PoolingConfig

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    *, stream: bool = True, salt: str | None = None, priority: int = 0,
                    deadline: float | None = None, arrival_time: float | None = None,
                    pooling: PoolingParams | None = None) -> None: ...

    def abort_request(self, request_id: str) -> bool: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[StepDelta]: ...

    def fail_all(self, error: EngineError) -> list[StepDelta]: ...

    def stats(self) -> EngineStats: ...


@runtime_checkable
class HandoverLoop(Protocol):
    """An EngineLoop that continues requests prefilled elsewhere (``role=decode``)."""
    accepts_handover: Literal[True]

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams | None = None, *,
               handover: str | None = None, **kw: Any) -> None: ...


def takes_handover(loop: object) -> bool:
    """Whether ``loop`` takes hand-over records (a class setting ``accepts_handover = False``
    declares that it does not)."""
    return isinstance(loop, HandoverLoop) and bool(loop.accepts_handover)
