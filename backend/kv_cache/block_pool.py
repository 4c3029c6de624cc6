"""Device block metadata: ref counts, the LRU free list, the hash -> cached block map, and the
hash chain that names a cached block.

The free list holds every block with ref_cnt == 0, in eviction order (head is taken first)::

    head -> [uncached blocks ...][cached blocks, least recently freed ... most recently freed] <- tail

Uncached free blocks carry nothing worth keeping, so they go to the head; freed cached blocks go
to the tail and so live longest. A free block that still has a hash is a cache entry: a prefix hit
"revives" it (removed from the middle of the list in O(1)); taking it for new data evicts it.

A cached block is named by a hash chain over (parent hash, token ids, extra keys)::

    block 0: h0 = H(ROOT_HASH, tokens[0:bs],   salt)
    block 1: h1 = H(h0,        tokens[bs:2bs], salt)      ...

``salt`` is the request's extra key: the tenant's (or allowed client's) cache salt, and the LoRA
adapter's identity (:func:`extra_key`), so KV computed under one adapter is never reused by
another adapter or by the base model.

A hash names a block *and its whole prefix*, so equal hashes mean "same KV" up to collisions.
Collisions are ruled out separately by comparing a :data:`CacheKey` (see ``manager.py``).

hashlib, not Python's ``hash()``: the latter is salted per process (PYTHONHASHSEED), and the disk
tier and any future cross-process cache need a stable name for the same prefix.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

ROOT_HASH = b""   # parent of the first block
ROOT_ID = 0       # cache-entry id of that (virtual) parent; real entries start at 1

# What a cached block stores to confirm a hash hit exactly:
#   (entry id of the parent block, this block's token ids, extra key e.g. tenant salt)
# Comparing the parent's *entry id* (not its hash) makes a hit exact even if every hash collides:
# entry ids are unique per cached content and never reused.
CacheKey = tuple[int, tuple[int, ...], "str | None"]


def extra_key(salt: str | None, lora_uid: str | None) -> str | None:
    """The chain's extra key for a tenant ``salt`` and an adapter (``LoRAAdapter.uid``: name and
    content digest). Length-prefixed, so no salt can spell another (salt, adapter) pair."""
    if lora_uid is None:
        return salt
    return f"lora:{len(lora_uid)}:{lora_uid}|" + ("" if salt is None else f"salt:{salt}")


def hash_block(parent_hash: bytes, token_ids: Sequence[int], salt: str | None = None) -> bytes:
    """16-byte blake2b digest of one full block, chained on ``parent_hash``."""
    h = hashlib.blake2b(digest_size=16)
    h.update(len(parent_hash).to_bytes(1, "little"))   # length prefixes keep the encoding unambiguous
    h.update(parent_hash)
    salt_bytes = b"" if salt is None else b"\x01" + salt.encode("utf-8")
    h.update(len(salt_bytes).to_bytes(4, "little"))
    h.update(salt_bytes)
    h.update(array("q", token_ids).tobytes())          # int64: any vocabulary size fits
    return h.digest()


class KVCacheBlock:
    """One device block. ``block_hash``/``key``/``entry_id`` are set once, when it is cached."""
    __slots__ = ("block_id", "ref_cnt", "block_hash", "key", "entry_id", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.key: CacheKey | None = None
        self.entry_id = 0
        # Intrusive links: the free list needs no side structure and removes in O(1).
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels; every operation is O(1)."""

    def __init__(self, blocks: Iterable[KVCacheBlock]):
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        assert block is not None and block is not self._tail, "free list is empty"
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free list"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None, "the tail sentinel is always linked"
        self._insert_after(last, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"{block} is already free"
        nxt = prev.next_free
        assert nxt is not None, f"{prev} is not in the free list"
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = nxt.prev_free = block
        self.num_free += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        b = self._head.next_free
        while b is not None and b is not self._tail:     # None only past a broken link
            yield b
            b = b.next_free

    def ids(self) -> list[int]:
        """Block ids head to tail (eviction order); for tests and debugging."""
        return [b.block_id for b in self]

    def check(self) -> None:
        """Links are mutually consistent and the count matches."""
        n, b = 0, self._head
        while b.next_free is not None:
            assert b.next_free.prev_free is b, "broken free-list link"
            b = b.next_free
            n += 1
        assert b is self._tail and n - 1 == self.num_free, "free-list count mismatch"


@dataclass
class EvictedBlock:
    """What an evicted cached block carried, captured before the block is reused."""
    block_id: int
    block_hash: bytes
    key: CacheKey
    entry_id: int


class BlockPool:
    """All device blocks, the free list and the prefix-cache map. Knows nothing of sequences."""

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}   # hash -> the one device block holding it

    @property
    def num_free(self) -> int:
        return self.free.num_free

    def take(self, n: int) -> tuple[list[KVCacheBlock], list[EvictedBlock]]:
        """Pop n blocks from the head (ref 1 each). Cached ones are evicted and reported so the
        caller can copy their content out before anything overwrites it."""
        assert n <= self.num_free, f"take({n}) with {self.num_free} free"
        taken, evicted = [], []
        for _ in range(n):
            block = self.free.popleft()
            if block.block_hash is not None:
                assert block.key is not None, "a cached block has its key"
                evicted.append(EvictedBlock(block.block_id, block.block_hash, block.key, block.entry_id))
                del self.cached[block.block_hash]
                block.block_hash, block.key, block.entry_id = None, None, 0
            block.ref_cnt = 1
            taken.append(block)
        return taken, evicted

    def touch(self, block: KVCacheBlock) -> None:
        """One more holder; a free cached block leaves the free list (a prefix hit revives it)."""
        if block.ref_cnt == 0:
            self.free.remove(block)
        block.ref_cnt += 1

    def release(self, block: KVCacheBlock) -> None:
        """One holder fewer; at 0 the block becomes free (cached: tail, uncached: head)."""
        assert block.ref_cnt > 0, f"release of free {block}"
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            if block.block_hash is not None:
                self.free.append(block)
            else:
                self.free.appendleft(block)

    def cache(self, block: KVCacheBlock, block_hash: bytes, key: CacheKey, entry_id: int) -> None:
        """Register a full block under its hash (the caller checked the hash is not cached)."""
        assert block.block_hash is None and block_hash not in self.cached
        block.block_hash, block.key, block.entry_id = block_hash, key, entry_id
        self.cached[block_hash] = block

    def check(self) -> None:
        """Free list == blocks with ref 0; hash map == blocks with a hash."""
        self.free.check()
        free_ids = self.free.ids()
        assert len(set(free_ids)) == len(free_ids), "block twice in the free list"
        assert set(free_ids) == {b.block_id for b in self.blocks if b.ref_cnt == 0}, \
            "free list disagrees with ref counts"
        assert all(b.ref_cnt >= 0 for b in self.blocks)
        hashed = {b.block_hash: b for b in self.blocks if b.block_hash is not None}
        assert len(hashed) == sum(b.block_hash is not None for b in self.blocks), "duplicate hash on device"
        assert hashed == self.cached, "hash map disagrees with block hashes"
