"""Build a :class:`BatchInput` from per-sequence chunks (the engine's step, tests, benchmarks).

Each chunk is "these new tokens of one sequence, after ``num_computed`` already cached tokens, with
this block table". Index arithmetic, for a sequence with ``num_computed=5`` and 3 new tokens,
``block_size=4`` and block table ``[7, 2]``::

    positions     5  6  7          (num_computed + i)
    block         2  2  2          (block_table[pos // block_size] -> table[1])
    slot          9 10 11          (block * block_size + pos % block_size)
    seq_len       8                (num_computed + new tokens)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.model.runner import BatchInput


@dataclass
class SeqChunk:
    token_ids: list[int]          # this step's new tokens of the sequence
    num_computed: int             # tokens of the sequence already in the KV cache
    block_table: list[int]        # block ids covering at least num_computed + len(token_ids) tokens
    all_logits: bool = False      # logits for every new token, not only the last
    logits: bool = True           # False: no logits row (a prefill chunk that does not sample yet)


def build_batch(chunks: list[SeqChunk], block_size: int, device: str | torch.device = "cpu") -> BatchInput:
    """All host lists first, then two tensors (the int64 fields, the int32 fields) that every field
    is a view of: one host-to-device copy per dtype per step, and ~6 fewer tensor constructions
    (each ~10-20 us, felt when a whole decode step of a small model takes ~2 ms)."""
    ids, positions, slots, cu, seq_lens, logits = [], [], [], [0], [], []
    for c in chunks:
        n = len(c.token_ids)
        end = c.num_computed + n
        if n == 0 or len(c.block_table) * block_size < end:
            raise ValueError(f"chunk needs >= 1 token and a block table covering {end} tokens")
        row0 = len(ids)
        for pos in range(c.num_computed, end):
            positions.append(pos)
            slots.append(c.block_table[pos // block_size] * block_size + pos % block_size)
        ids.extend(c.token_ids)
        cu.append(len(ids))
        seq_lens.append(end)
        if c.logits:
            logits.extend(range(row0, row0 + n) if c.all_logits else [row0 + n - 1])
    width = max(len(c.block_table) for c in chunks)
    tables = []
    for c in chunks:
        tables += c.block_table
        tables += [0] * (width - len(c.block_table))
    n, s = len(ids), len(chunks)
    wide = torch.tensor(ids + positions + slots + logits, dtype=torch.int64)
    narrow = torch.tensor(cu + seq_lens + tables, dtype=torch.int32)
    if torch.device(device).type != "cpu":
        wide, narrow = wide.to(device), narrow.to(device)
    return BatchInput(
        input_ids=wide[:n],
        positions=wide[n:2 * n],
        slot_mapping=wide[2 * n:3 * n],
        cu_seqlens_q=narrow[:s + 1],
        seq_lens=narrow[s + 1:2 * s + 1],
        block_tables=narrow[2 * s + 1:].view(s, width),
        logits_indices=wide[3 * n:],
        max_seqlen_q=max(len(c.token_ids) for c in chunks),
        max_seq_len=max(seq_lens),
    )
