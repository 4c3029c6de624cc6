"""Paged KV cache: one preallocated block pool, prefix caching, copy-on-write, offload tiers.

The scheduler talks only to :class:`KVCacheManager`; the model runner reads block tables and
slot mappings from it and the KV tensors from :class:`KVCacheStorage`.
"""
from backend.kv_cache.manager import KVCacheManager, KVCacheStats
from backend.kv_cache.storage import KVCacheStorage

__all__ = ["KVCacheManager", "KVCacheStats", "KVCacheStorage"]
