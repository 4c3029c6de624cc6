"""Read-only views of a KVCacheManager for the KV tests (production asks none of these).

``slots`` is the same arithmetic the model's batch builder (backend/model/runner.py) does
for the flattened batch; ``cached_tokens`` is what ``acquire_prefix`` would attach, read without
its side effects (no LRU touch, no swap-in, no stats).
"""
from __future__ import annotations


def slots(m, seq_id: str, start: int, end: int) -> list[int]:
    """KV slots of token positions [start, end) of a sequence (its block table must cover them)."""
    table, bs = m.block_table(seq_id), m.block_size
    assert 0 <= start <= end <= len(table) * bs, f"[{start}, {end}) past the table's {len(table) * bs} tokens"
    return [table[p // bs] * bs + p % bs for p in range(start, end)]


def cached_tokens(m, token_ids: list[int], salt: str | None = None) -> int:
    """Tokens of the longest cached prefix (device or offload tiers)."""
    return len(m._match(token_ids, salt)) * m.block_size


def free_blocks(m) -> int:
    """Blocks with ref 0, cached ones included (they are reclaimable)."""
    return m.num_blocks - m.stats().num_used_blocks
