"""KVCacheManager: the only object the scheduler uses to reserve KV memory.

Per sequence (keyed by ``seq_id``) it keeps a block table and the hash chain of its full blocks.
Contract with the scheduler (vLLM v1 style: opaque, all-or-nothing):

    n = mgr.acquire_prefix(seq_id, token_ids, salt)   # first time only: attach cached blocks
    ok = mgr.allocate_slots(seq_id, num_tokens)       # ensure room for num_tokens total tokens
    ... model runs, writing KV via slot_mapping(seq_id, start, end) ...
    mgr.commit(seq_id, token_ids, num_computed)       # cache blocks that became full
    mgr.fork(parent_id, child_id)                     # n > 1: share every block (ref + 1)
    mgr.free(seq_id)                                  # finish / abort / preempt
"""
from __future__ import annotations

from dataclasses import dataclass

from backend.kv_cache.storage import KVCacheStorage


@dataclass
class KVCacheStats:
    """Counters for metrics (monotonic except the two gauges)."""
    num_blocks: int = 0
    num_used_blocks: int = 0          # gauge: blocks with ref_cnt > 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0        # includes tokens swapped in from the offload tiers
    evictions: int = 0                # cached blocks evicted from the device pool
    offload_out_blocks: int = 0
    offload_out_bytes: int = 0
    offload_in_blocks: int = 0
    offload_in_bytes: int = 0
    cow_copies: int = 0

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0


class KVCacheManager:
    def __init__(self, *, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 storage: KVCacheStorage | None = None, host_tier_blocks: int = 0,
                 disk_tier_path: str | None = None, disk_tier_blocks: int = 0):
        """``storage`` may be None in allocator-only tests (then CoW/offload copy nothing)."""
        raise NotImplementedError

    # -- queries -------------------------------------------------------------------------
    @property
    def block_size(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...

    def lookup_prefix(self, token_ids: list[int], salt: str | None = None) -> int:
        """Tokens of the longest cached prefix (device or offload tiers); read-only.
        A multiple of block_size and always < len(token_ids)."""
        raise NotImplementedError

    # -- per-sequence operations ----------------------------------------------------------
    def acquire_prefix(self, seq_id: str, token_ids: list[int], salt: str | None = None) -> int | None:
        """First call for a sequence: attach its cached prefix blocks (ref + 1; swap-in from the
        offload tiers if needed) and return the number of cached tokens. None if the swap-in
        needs device blocks that are not free (nothing changed)."""
        raise NotImplementedError

    def allocate_slots(self, seq_id: str, num_tokens: int) -> bool:
        """Make the block table cover ``num_tokens`` tokens in total. Copy-on-write a shared,
        partially filled last block first. False = not enough free blocks, nothing changed."""
        raise NotImplementedError

    def can_allocate(self, seq_id: str, num_tokens: int) -> bool: ...

    def commit(self, seq_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """The first num_computed_tokens of token_ids now have KV: hash and cache newly full blocks."""
        raise NotImplementedError

    def fork(self, parent_id: str, child_id: str) -> None:
        raise NotImplementedError

    def free(self, seq_id: str) -> None:
        """Release a sequence's blocks, tail first; unknown ids are a no-op."""
        raise NotImplementedError

    def block_table(self, seq_id: str) -> list[int]:
        raise NotImplementedError

    def slot_mapping(self, seq_id: str, start: int, end: int) -> list[int]:
        """Slots for token positions [start, end)."""
        raise NotImplementedError

    def stats(self) -> KVCacheStats:
        raise NotImplementedError

    def check_integrity(self) -> None:
        """Assert: every block free xor referenced; ref counts == number of tables holding it;
        hash map and free list agree."""
        raise NotImplementedError
