"""Embedding requests: a request kind of the one scheduler, not a second engine.

An embedding request is a prompt-only :class:`Request` (``request.pooling`` set). It waits, is
admitted and chunked under the same token budget as every prompt, and takes KV blocks only for its
own forward pass; the step whose chunk reaches its last token pools the final-normed hidden states
and finishes it, which frees its blocks at once. It never samples and never decodes.

    chunk rows in the step   [ gen | emb chunk 1 ........ | gen ]     (mean: every row of every chunk,
    hidden_indices                 ^^^^^^^^^^^^^^^^^^^^           summed into seq.pool_sum;
                                                                  last: the final chunk's last row)

Prefix cache: with last-token pooling an embedding request reads cached prefix blocks (the last
token's state only needs their KV); with mean pooling it computes every token (a cached block has
no hidden states). It commits nothing: one-off retrieval inputs would otherwise push a chat's
cached history out of the LRU.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from backend.engine.admission import EngineLimits, token_ids_ok
from backend.errors import invalid_request
from backend.model.pooling import PoolingConfig, finish_vector
from backend.outputs import StepDelta
from backend.errors import InvalidSamplingParam
from backend.pooling_params import PoolingParams

if TYPE_CHECKING:
    from backend.engine.sequence import Sequence


class ResolvedPooling:
    """One request's pooling: the model's type, the request's (or model's) normalize, dimensions."""
    __slots__ = ("pooling_type", "normalize", "dimensions")

    def __init__(self, pooling_type: str, normalize: bool, dimensions: int | None):
        self.pooling_type, self.normalize, self.dimensions = pooling_type, normalize, dimensions


def validate_embed(limits: EngineLimits, model: PoolingConfig, request_id: str, prompt_token_ids: list[int],
                   params: PoolingParams) -> ResolvedPooling:
    """Raise EngineError(invalid_request) naming the field; the request's resolved pooling."""
    if not isinstance(request_id, str) or not request_id:
        raise invalid_request("request_id", "request_id must be a non-empty string")
    if not isinstance(params, PoolingParams):
        raise invalid_request("parameters", f"pooling params must be PoolingParams, got {type(params).__name__}")
    try:
        params.validate()
    except InvalidSamplingParam as exc:
        raise invalid_request(exc.param, str(exc)) from None
    n = len(prompt_token_ids)
    if n == 0:
        raise invalid_request("input_ids", "the input is empty: at least one token is needed")
    if not token_ids_ok(prompt_token_ids, limits.vocab_size):
        raise invalid_request("input_ids", f"token ids must be integers in [0, {limits.vocab_size})")
    if n > limits.max_model_len:
        raise invalid_request("input_ids", f"the input has {n} tokens; at most {limits.max_model_len} "
                                           "(the context window) can be embedded")
    dims = params.dimensions
    if dims is not None:
        if not model.is_matryoshka:
            raise invalid_request("dimensions", "this model does not support dimensions: its config declares "
                                                "no Matryoshka representation (matryoshka_dimensions)")
        if model.matryoshka_dimensions and dims not in model.matryoshka_dimensions:
            raise invalid_request("dimensions", f"dimensions must be one of {list(model.matryoshka_dimensions)}, "
                                                f"got {dims}")
        if model.hidden_size and dims > model.hidden_size:
            raise invalid_request("dimensions", f"dimensions must be at most {model.hidden_size}, got {dims}")
    normalize = model.normalize if params.normalize is None else params.normalize
    return ResolvedPooling(model.pooling_type, normalize, dims)


def prefix_tokens(seq: Sequence) -> list[int]:
    """What the scheduler looks up in the prefix cache: everything but under mean pooling (one
    token never matches a block, so every token is computed and has a hidden state)."""
    pooling = seq.request.pooling
    return seq.token_ids if pooling is None or pooling.pooling_type == "last" else seq.token_ids[:1]


def hidden_rows(scheduled: list[tuple[Sequence, int]]) -> list[int]:
    """The step's rows whose hidden states the embedding requests need."""
    rows: list[int] = []
    row0 = 0
    for seq, num_new in scheduled:
        pooling = seq.request.pooling
        if pooling is not None:
            if pooling.pooling_type == "mean":
                rows.extend(range(row0, row0 + num_new))
            elif seq.num_computed_tokens + num_new == seq.num_tokens:
                rows.append(row0 + num_new - 1)
        row0 += num_new
    return rows


def absorb(scheduled: list[tuple[Sequence, int]], hidden: torch.Tensor) -> list[Sequence]:
    """Before ``update_from_output``: fold the step's hidden rows (``hidden_rows`` order) into each
    embedding sequence; those whose chunk reached the last token get ``seq.embedding``."""
    done, i = [], 0
    for seq, num_new in scheduled:
        pooling = seq.request.pooling
        if pooling is None:
            continue
        last = seq.num_computed_tokens + num_new == seq.num_tokens
        if pooling.pooling_type == "mean":
            part = hidden[i:i + num_new].sum(0)
            i += num_new
            # A chunk from token 0 starts the sum again (a preempted request recomputes from 0).
            if seq.num_computed_tokens == 0 or seq.pool_sum is None:
                assert seq.num_computed_tokens == 0, "a later chunk follows its first"
                seq.pool_sum = part
            else:
                seq.pool_sum = seq.pool_sum + part
            pooled: torch.Tensor | None = seq.pool_sum / seq.num_tokens if last else None
        elif last:
            pooled = hidden[i]
            i += 1
        else:
            pooled = None
        if pooled is not None:
            seq.embedding = finish_vector(pooled, normalize=pooling.normalize, dimensions=pooling.dimensions)
            seq.pool_sum = None
            done.append(seq)
    return done


def embedding_delta(seq: Sequence) -> StepDelta:
    """An embedding request's one (final) delta."""
    req = seq.request
    return StepDelta(request_id=req.request_id, index=0, new_token_ids=[], window_ids=[], num_sent=0,
                     finished=True, finish_reason=seq.finish_reason, error=seq.error,
                     prompt_tokens=seq.num_prompt_tokens, cached_tokens=req.num_cached_tokens,
                     queue_time=req.queue_time, num_preemptions=seq.num_preemptions,
                     embedding=seq.embedding)

