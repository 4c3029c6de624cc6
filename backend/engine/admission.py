"""Admission: which requests can ever run, decided from limits fixed when the engine starts.

Pure functions over an immutable :class:`EngineLimits`, so any thread may call them (the Triton
execute thread validates through EngineLoop.submit without touching engine state). Every
rejection is an :class:`~backend.errors.EngineError` naming the offending request field.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from backend.errors import EngineError, invalid_request, queue_full
from backend.sampling_params import InvalidSamplingParam, SamplingParams


@dataclass(frozen=True)
class EngineLimits:
    """What the engine can hold; captured once at startup and never changed."""
    vocab_size: int
    max_model_len: int          # context window: the model's, clamped to what the KV pool holds
    max_num_seqs: int
    max_waiting: int


def validate_request(limits: EngineLimits, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams | None) -> int:
    """Raise EngineError(invalid_request) for a request that can never run; return its
    resolved max_tokens (never None)."""
    if not isinstance(request_id, str) or not request_id:
        raise invalid_request("request_id", "request_id must be a non-empty string")
    if params is not None and not isinstance(params, SamplingParams):
        raise invalid_request("parameters", f"sampling params must be SamplingParams, "
                                            f"got {type(params).__name__}")
    params = params or SamplingParams()
    try:
        params.validate()       # the caller may have changed a field after construction
    except InvalidSamplingParam as exc:
        raise invalid_request(exc.param, str(exc)) from None
    n = len(prompt_token_ids)
    if n == 0:
        raise invalid_request("input_ids", "prompt is empty: at least one token is needed")
    vocab = limits.vocab_size
    if not token_ids_ok(prompt_token_ids, vocab):
        raise invalid_request("input_ids", f"prompt token ids must be integers in [0, {vocab})")
    limit = limits.max_model_len
    if n >= limit:
        raise invalid_request("input_ids", f"prompt has {n} tokens, which leaves no room to generate: "
                                           f"max_model_len is {limit} tokens")
    max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
    if n + max_tokens > limit:
        raise invalid_request("max_tokens", f"prompt has {n} tokens and max_tokens is {max_tokens}: "
                                            f"{n + max_tokens} tokens exceed max_model_len of {limit} tokens")
    if params.min_tokens > max_tokens:
        raise invalid_request("min_tokens", f"min_tokens ({params.min_tokens}) must not exceed "
                                            f"max_tokens ({max_tokens})")
    if params.n > limits.max_num_seqs:
        raise invalid_request("n", f"n ({params.n}) exceeds max_num_seqs ({limits.max_num_seqs})")
    return max_tokens


def token_ids_ok(ids: list[int], vocab: int) -> bool:
    """Every id an int (not a bool) in [0, vocab). Plain ints (what every caller passes) are checked
    with C-level passes (the per-id generator was ~20 us per 130-token prompt, twice per request on
    the way to its first token); anything else one by one."""
    if set(map(type, ids)) == {int}:
        return 0 <= min(ids) and max(ids) < vocab
    return all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids)


def check_queue(limits: EngineLimits, num_waiting: int) -> None:
    """Raise EngineError(queue_full) when ``num_waiting`` requests already fill the queue."""
    if num_waiting >= limits.max_waiting:
        # About one running batch's worth of work per max_num_seqs waiting requests.
        retry_after = float(max(1, math.ceil(num_waiting / max(1, limits.max_num_seqs))))
        raise queue_full(f"{num_waiting} requests are waiting (max_waiting={limits.max_waiting})",
                         retry_after=retry_after)


def duplicate_id(request_id: str) -> EngineError:
    return invalid_request("request_id", f"request_id {request_id!r} is already in use")
