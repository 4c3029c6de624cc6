"""What the engine model's threads hand each other: a request's handle and the typed queue messages.

    execute() thread ── Opened / Rejected ──────────┐
    engine thread ───── DeltaArrived (the sink) ────┼──► response queue ──► response thread
    abort future ────── ControlAnswered ────────────┘        (STOP ends it)

Every message for one request goes through the one queue, so the response thread sees them in the
order they were put: ``Opened`` always before the request's first ``DeltaArrived``. ``STOP`` is the
one stop sentinel of the serving threads (the response thread and the metrics thread).
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from backend.errors import EngineError
from backend.outputs import STOP, Stop  # noqa: F401  (the one stop sentinel, shared with the engine loop)
from backend.outputs import StepDelta


class Responder(Protocol):
    """One request's response sender (model.py wraps pb_utils' ResponseSender)."""

    def send(self, outputs: dict | None = None, *, error: EngineError | None = None,
             final: bool = False) -> None: ...

    def is_cancelled(self) -> bool: ...


@dataclass
class Incoming:
    """A request as execute() copied it out of pb_utils."""
    request_id: str
    input_ids: list[int] | None
    parameters: str | dict | None
    responder: Responder
    timeout_s: float | None = None          # Triton's own request timeout, if the client set one
    oversize: int = 0                       # input_ids longer than the context window: its length
                                            # (model.py checks before converting to a list)
    requested_outputs: frozenset[str] | None = None     # output names the caller asked for (None: all)


@dataclass(eq=False)                        # identity: two requests may share an id (one is rejected)
class RequestHandle:
    """One admitted-or-rejected request as the response thread tracks it (response thread only,
    except the fields intake sets before posting ``Opened``)."""
    rid: str
    responder: Responder
    arrival: float
    remaining: int = 1                      # choices whose final delta has not arrived
    stream: bool = True
    cancelled: bool = False                 # the client went away: no more data, bare FINAL
    done: bool = False                      # FINAL sent
    last_check: float = 0.0                 # last is_cancelled() round trip
    first_token: float | None = None        # latency bookkeeping (metrics.py LatencyRecorder)
    last_token: dict[int, float] = field(default_factory=dict)
    queue_time_seen: bool = False
    want: frozenset[str] | None = None      # output names to build (None: all; postprocess.py)
    skip_special_tokens: bool = True        # for the text outputs (backend/serving/postprocess.py)
    cancel_every: float = 0.0               # is_cancelled() at most this often (response_thread.py)
    held: dict[int, "Held"] = field(default_factory=dict)   # choice -> its gathered, unsent delta
    pace: dict = field(default_factory=dict)  # choice -> its pace between deltas (hold_policy.Pace)
    lora: str | None = None                 # its LoRA adapter's name, for the per-adapter metrics


@dataclass(slots=True)
class Held:
    """A choice's mid-stream tokens the response thread gathers (merged deltas), sent by ``due``."""
    delta: StepDelta
    due: float


@dataclass(slots=True)
class Opened:
    """Register the request before the engine can produce a delta for it."""
    handle: RequestHandle


@dataclass(slots=True)
class Rejected:
    """Admission failed: one error response with FINAL."""
    handle: RequestHandle
    error: EngineError


@dataclass(slots=True)
class DeltaArrived:
    """One choice's progress in one engine step (what the EngineLoop sink posts)."""
    handle: RequestHandle
    delta: StepDelta


@dataclass(slots=True)
class ControlAnswered:
    """An explicit abort (``abort_request_id``) came back from the engine; ``freed`` resolves to
    the instant the target's blocks were freed, or None if it was not running."""
    target: str
    responder: Responder
    seen: float                             # when the abort request arrived
    freed: Future


Message = Opened | Rejected | DeltaArrived | ControlAnswered | Stop
