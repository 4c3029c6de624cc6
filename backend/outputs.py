"""What the engine hands back: per-step deltas (server) and finished results (offline API)."""
from __future__ import annotations

from dataclasses import dataclass, field

from backend.errors import EngineError


class Stop:
    """The one sentinel that ends every queue-draining thread (engine intake, responses, metrics)."""

    def __repr__(self) -> str:
        return "STOP"


STOP = Stop()


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class StepDelta:
    """One request choice's progress in one engine step (what the server streams).

    ``window_ids`` / ``num_sent`` feed the stateless detokenizer (backend/detokenizer.py):
    the text delta is decode(window_ids) minus decode(window_ids[:num_sent]), cut to
    ``max_chars`` characters when a stop string matched. Tokens whose text could still begin a
    stop string are held back by the engine and appear in a later delta.
    """
    request_id: str
    index: int                              # choice index (n > 1)
    new_token_ids: list[int]
    window_ids: list[int]
    num_sent: int
    max_chars: int = -1                     # -1 = no cut
    finished: bool = False
    finish_reason: str | None = None        # "stop" | "length" | "abort" | "error"
    # Why the engine ended the choice, set only then: kind deadline with finish_reason "abort"
    # (the request's deadline passed); internal / unavailable with "error" (the engine failed).
    error: EngineError | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_time: float = 0.0                 # seconds from arrival to first schedule
    num_preemptions: int = 0
    # speculative decoding, cumulative for the choice: drafts verified / accepted, and the steps
    # that verified drafts (accepted tokens per step = spec_accepted_tokens / spec_steps)
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_steps: int = 0
    embedding: list[float] | None = None    # an embedding request's vector (its one, final delta)


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    num_cached_tokens: int
    outputs: list[CompletionOutput]
    finished: bool = True


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """``LLM.embed`` results (vLLM's shape: ``out.outputs.embedding``)."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
