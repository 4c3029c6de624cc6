"""The step's flattened, unpadded :class:`BatchInput` from the scheduler's chunks.

Sequences go back to back; each contributes its chunk of new tokens::

    input_ids     [ s0 chunk ....... | s1 | s2 chunk .... | s3 ]
    cu_seqlens_q  0                  5    6               10   11
    logits rows   only for sequences whose chunk reaches their last known token (they sample):
                  cu_seqlens_q[i + 1] - 1   (the scheduler's SchedulerOutput.sampling, in order)

A decoding sequence with k draft tokens (speculative decoding) contributes its last token plus
the drafts, and every one of those k + 1 rows gets logits (the target's distribution after each
prefix of the drafts, which verification compares against)::

    input_ids     [ t_last d0 d1 d2 ]    logits rows  4 (all of them)

An embedding request's chunk has no logits row; its rows go in ``hidden_indices`` instead.
The index arithmetic (positions, slots, padded block tables) is backend/model/batch_builder.py's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from backend.engine.embedding import hidden_rows
from backend.engine.sequence import Sequence
from backend.lora.batch import LoRABatch
from backend.model.batch_builder import SeqChunk
from backend.model.batch_builder import build_batch as build_chunks
from backend.model.runner import BatchInput

if TYPE_CHECKING:
    from backend.kv_cache.manager import KVCacheManager


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
