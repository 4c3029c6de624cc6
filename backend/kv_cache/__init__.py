"""Paged KV cache: one preallocated block pool, prefix caching, copy-on-write, offload tiers.

The scheduler talks only to :class:`KVCacheManager`; the model runner reads block tables and
slot mappings from it and the KV tensors from :class:`KVCacheStorage`.

    manager.py     KVCacheManager: per-sequence block tables, prefix match, CoW, stats
    block_pool.py  KVCacheBlock, the O(1) LRU free list, the hash -> cached block map, the block
                   hash chain and the exact key that confirms a hit
    offload.py     host-memory and disk tiers that catch evicted cached blocks
    storage.py     the KV tensor kv[layer, k/v, block, offset, head, dim]
"""
from backend.kv_cache.manager import KVCacheManager, KVCacheStats
from backend.kv_cache.storage import KVCacheStorage

__all__ = ["KVCacheManager", "KVCacheStats", "KVCacheStorage"]
