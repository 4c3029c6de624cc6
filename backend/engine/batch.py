"""Build the runner's flattened, unpadded :class:`BatchInput` for one step.

Sequences go back to back; each contributes its chunk of new tokens::

    input_ids     [ s0 chunk ....... | s1 | s2 chunk .... | s3 ]
    cu_seqlens_q  0                  5    6               10   11
    logits rows   only for sequences whose chunk reaches their last known token (they sample):
                  cu_seqlens_q[i + 1] - 1

All host lists are built first and turned into tensors once per step.
"""
from __future__ import annotations

import torch

from backend.engine.sequence import Sequence
from backend.model.runner import BatchInput


def build_batch(scheduled: list[tuple[Sequence, int]], kv, device: str | torch.device = "cpu"
                ) -> tuple[BatchInput, list[Sequence]]:
    """Returns the batch and the sequences that sample, in logits-row order."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    logits_indices: list[int] = []
    samplers: list[Sequence] = []
    max_q = 0
    for seq, num_new in scheduled:
        start = seq.num_computed_tokens
        end = start + num_new
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        slots.extend(kv.slot_mapping(seq.seq_id, start, end))
        cu.append(cu[-1] + num_new)
        seq_lens.append(end)
        tables.append(kv.block_table(seq.seq_id))
        max_q = max(max_q, num_new)
        if end == seq.num_tokens:
            logits_indices.append(cu[-1] - 1)
            samplers.append(seq)
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]

    def t(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    batch = BatchInput(
        input_ids=t(input_ids, torch.int64),
        positions=t(positions, torch.int64),
        slot_mapping=t(slots, torch.int64),
        cu_seqlens_q=t(cu, torch.int32),
        seq_lens=t(seq_lens, torch.int32),
        block_tables=t(padded, torch.int32),
        logits_indices=t(logits_indices, torch.int64),
        max_seqlen_q=max_q,
        max_seq_len=max(seq_lens),
    )
    return batch, samplers
