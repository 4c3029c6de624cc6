"""The scheduler's step contract: what runs (``SchedulerOutput``), which rows sample
(``plan_sampling``), the flattened batch built from it (``build_batch``), and what
``Scheduler.update_from_output`` changed (``StepOutcome``).

The step's flattened, unpadded :class:`BatchInput`: sequences go back to back; each contributes
its chunk of new tokens::

    input_ids     [ s0 chunk ....... | s1 | s2 chunk .... | s3 ]
    cu_seqlens_q  0                  5    6               10   11
    logits rows   only for sequences whose chunk reaches their last known token (they sample):
                  cu_seqlens_q[i + 1] - 1   (the scheduler's SchedulerOutput.sampling, in order)

A decoding sequence with k draft tokens (speculative decoding) contributes its last token plus
the drafts, and every one of those k + 1 rows gets logits (the target's distribution after each
prefix of the drafts, which verification compares against)::

    input_ids     [ t_last d0 d1 d2 ]    logits rows  4 (all of them)

An embedding request's chunk has no logits row; its rows go in ``hidden_indices`` instead.
The index arithmetic (positions, slots, padded block tables) is backend/model/runner.py's ``build_batch``.
"""
from __future__ import annotations

from collections import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from backend.engine.embedding import hidden_rows
from backend.engine.sequence import Request, Sequence
from backend.lora.batch import LoRABatch
from backend.model.runner import BatchInput, SeqChunk
from backend.model.runner import build_batch as build_chunks
from backend.outputs import TokenLogprob

if TYPE_CHECKING:
    from backend.kv_cache.manager import KVCacheManager

# What a step sampled for ``SchedulerOutput.sampling[i]``: one token id, or for a sequence that
# verified drafts the list of its accepted drafts plus one sampled token; its logprob(s) alike.
SampledTokens = abc.Sequence[int | list[int]]
SampledLogprobs = abc.Sequence[TokenLogprob | None | list[TokenLogprob | None]]


@dataclass
class SchedulerOutput:
    """What runs this step: each sequence with its chunk [num_computed_tokens, + num_new)."""
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    new_requests: list[Request] = field(default_factory=list)   # scheduled for the first time
    num_batched_tokens: int = 0
    # The sequences that sample this step (new forked choices right after their choice 0) and
    # the logits row each samples from; None = row i for sequence i (no fork this step).
    sampling: list[Sequence] = field(default_factory=list)
    logit_rows: list[int] | None = None
    forks: list[Sequence] = field(default_factory=list)         # new choices, registered in update
    num_drafts: int = 0        # draft tokens to verify this step (their sequences' spec_token_ids)


@dataclass
class StepOutcome:
    """What ``update_from_output`` changed (for deltas and stats)."""
    sampled: list[Sequence] = field(default_factory=list)      # got a token, in row order
    finished: list[Sequence] = field(default_factory=list)
    computed_tokens: int = 0
    recomputed_tokens: int = 0          # computed again after a preemption
    generated_tokens: int = 0           # tokens appended (accepted drafts included)
    drafted_tokens: int = 0             # draft tokens verified
    accepted_tokens: int = 0            # of those, accepted


def plan_sampling(out: SchedulerOutput) -> None:
    """A chunk that reaches its sequence's last token yields one logits row (build_batch), or
    k + 1 rows when it carries k draft tokens (``logit_rows`` then names each sequence's
    first row). An unforked n > 1 request samples all its choices from its one row: the
    prompt is shared."""
    rows: list[int] = []
    next_row = 0
    for seq, num_new in out.scheduled:
        if seq.request.pooling is not None:     # an embedding request pools instead (embedding.py)
            continue
        if seq.num_computed_tokens + num_new < seq.num_tokens + len(seq.spec_token_ids):
            continue
        row = next_row
        next_row += 1 + len(seq.spec_token_ids)
        out.num_drafts += len(seq.spec_token_ids)
        out.sampling.append(seq)
        rows.append(row)
        req = seq.request
        if not req.forked:
            for index in range(1, req.params.n):
                child = seq.fork(index)
                out.forks.append(child)
                out.sampling.append(child)
                rows.append(row)
    out.logit_rows = rows if out.forks or out.num_drafts else None


def build_batch(scheduled: list[tuple[Sequence, int]], kv: KVCacheManager, device: str | torch.device = "cpu",
                lora_info: dict[str, int] | None = None) -> BatchInput:
    """``lora_info``: the model's q_size / kv_size / intermediate when LoRA is on (else None)."""
    chunks: list[SeqChunk] = []
    pooled = False                          # an embedding request's chunk in the step
    for seq, num_new in scheduled:
        start = seq.num_computed_tokens
        end = start + num_new
        if seq.spec_token_ids:
            assert start == seq.num_tokens - 1 and num_new == 1 + len(seq.spec_token_ids), "drafts only on a decode"
            chunks.append(SeqChunk(seq.token_ids[start:] + seq.spec_token_ids, start,
                                   kv.block_table(seq.seq_id), all_logits=True))
            continue
        embed = seq.request.pooling is not None
        pooled |= embed
        chunks.append(SeqChunk(seq.token_ids[start:end], start, kv.block_table(seq.seq_id),
                               logits=end == seq.num_tokens and not embed))
    batch = build_chunks(chunks, kv.block_size, device)
    if lora_info is not None and any(seq.request.lora is not None for seq, _ in scheduled):
        batch.lora = LoRABatch.build([(seq.request.lora, len(c.token_ids)) for (seq, _), c in zip(scheduled, chunks)],
                                     q_size=lora_info["q_size"], kv_size=lora_info["kv_size"],
                                     intermediate=lora_info["intermediate"], device=device)
    rows = hidden_rows(scheduled) if pooled else None    # backend/engine/embedding.py
    if rows:                # (a last-token request's earlier chunks need none: any step path)
        batch.hidden_indices = torch.tensor(rows, dtype=torch.int64, device=device)
    return batch
