"""KVCacheManager: the only object the scheduler uses to reserve KV memory.

Per sequence (keyed by ``seq_id``) it keeps a block table and the hash chain of its full blocks.
Contract with the scheduler (vLLM v1 style: opaque, all-or-nothing):

    n = mgr.acquire_prefix(seq_id, token_ids, salt)   # first time only: attach cached blocks
    ok = mgr.allocate_slots(seq_id, num_tokens)       # ensure room for num_tokens total tokens
    ... model runs, writing KV at slots block_table(seq_id)[pos // bs] * bs + pos % bs ...
    mgr.commit(seq_id, token_ids, num_computed)       # cache blocks that became full
    mgr.fork(parent_id, child_id)                     # n > 1: share every block (ref + 1)
    mgr.free(seq_id)                                  # finish / abort / preempt
    mgr.truncate(seq_id, num_tokens)                  # rejected draft tokens: drop tail blocks

Call ``commit`` after every step even with prefix caching off: it also records how many tokens
have KV, which tells ``allocate_slots`` which shared blocks are about to be written (CoW).
Not thread-safe: call it from the engine thread only and hand ``stats()`` snapshots to others.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from backend.kv_cache import block_pool
from backend.kv_cache.block_pool import ROOT_HASH, ROOT_ID, BlockPool, CacheKey, KVCacheBlock
from backend.kv_cache.offload import OffloadChain
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


@dataclass
class _Seq:
    """One sequence's table and the tip of its hash chain (copied as-is by fork)."""
    blocks: list[KVCacheBlock]
    salt: str | None
    num_computed: int = 0            # tokens with KV written (last commit / prefix hit)
    num_hashed: int = 0              # leading full blocks already linked into the chain
    tip_hash: bytes = ROOT_HASH      # hash of block num_hashed - 1
    tip_id: int = ROOT_ID            # cache-entry id of that block's content
    # (queried, hit) tokens of acquire_prefix, counted at the first allocate_slots: a scheduler
    # that acquires and then frees (admission undone) must not count the same prompt every step.
    pending_query: tuple[int, int] | None = None


@dataclass
class _Hit:
    """One block of a prefix match: on the device (``block``) or in an offload tier."""
    block_hash: bytes
    key: CacheKey
    entry_id: int
    block: KVCacheBlock | None = None


class KVCacheManager:
    def __init__(self, *, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 storage: KVCacheStorage | None = None, host_tier_blocks: int = 0,
                 disk_tier_path: str | None = None, disk_tier_blocks: int = 0):
        """``storage`` may be None in allocator-only tests (then CoW/offload copy nothing)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if storage is not None and (storage.num_blocks, storage.block_size) != (num_blocks, block_size):
            raise ValueError(f"storage has {storage.num_blocks} blocks of {storage.block_size}, "
                             f"manager wants {num_blocks} of {block_size}")
        self._block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.storage = storage
        self.pool = BlockPool(num_blocks)
        self.offload = OffloadChain(
            block_shape=None if storage is None else storage.block_shape,
            dtype=storage.dtype if storage is not None else torch.float32,   # unused: no block_shape
            pin_memory=storage is not None and storage.device.type == "cuda",
            host_blocks=host_tier_blocks if enable_prefix_caching else 0,
            disk_path=disk_tier_path, disk_blocks=disk_tier_blocks if enable_prefix_caching else 0)
        self._tiered = bool(self.offload.tiers)     # fixed: without tiers the steps never enter offload.py
        self._block_bytes = 0 if storage is None else storage.block_bytes
        self._seqs: dict[str, _Seq] = {}
        self._next_entry_id = ROOT_ID + 1
        self._stats = KVCacheStats(num_blocks=num_blocks)

    # -- queries -------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return len(self.pool.blocks)

    # -- per-sequence operations ----------------------------------------------------------
    def acquire_prefix(self, seq_id: str, token_ids: list[int], salt: str | None = None) -> int | None:
        """First call for a sequence: attach its cached prefix blocks (ref + 1; swap-in from the
        offload tiers if needed) and return the number of cached tokens. None if the swap-in
        needs device blocks that are not free (nothing changed).
        The query counts in stats() once the sequence's first allocate_slots succeeds, so an
        admission undone by free() is not counted again on every retry."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already holds KV blocks; free it first")
        hits = self._match(token_ids, salt)
        to_swap = [h for h in hits if h.block is None]
        revived = sum(1 for h in hits if h.block is not None and h.block.ref_cnt == 0)
        if len(to_swap) > self.pool.num_free - revived:
            return None
        for h in hits:
            if h.block is not None:
                self.pool.touch(h.block)        # off the free list before _take can evict it
        # Take the contents out of the tiers *before* taking device blocks: the evictions those
        # blocks cause push into the tiers and could otherwise push these very entries out.
        contents = [self.offload.pop(h.block_hash)[1] for h in to_swap]
        fresh = iter(self._take(len(to_swap)))
        blocks, swapped_ids = [], []          # swapped_ids: to_swap's new blocks, in its order
        for h in hits:
            if h.block is None:
                h.block = next(fresh)
                self.pool.cache(h.block, h.block_hash, h.key, h.entry_id)
                swapped_ids.append(h.block.block_id)
            blocks.append(h.block)
        if to_swap and self.storage is not None:
            blobs = [c for c in contents if c is not None]
            assert len(blobs) == len(contents), "with storage every tier entry holds its content"
            self.storage.write_blocks(swapped_ids, torch.stack(blobs))
        self._stats.offload_in_blocks += len(to_swap)
        self._stats.offload_in_bytes += len(to_swap) * self._block_bytes
        n = len(hits) * self._block_size
        seq = _Seq(blocks, salt, num_computed=n, num_hashed=len(hits), pending_query=(len(token_ids), n))
        if hits:
            seq.tip_hash, seq.tip_id = hits[-1].block_hash, hits[-1].entry_id
        self._seqs[seq_id] = seq
        return n

    def allocate_slots(self, seq_id: str, num_tokens: int) -> bool:
        """Make the block table cover ``num_tokens`` tokens in total. Copy-on-write a shared,
        partially filled last block first. False = not enough free blocks, nothing changed."""
        seq = self._get(seq_id)
        num_new, cow = self._plan(seq, num_tokens)
        if num_new + len(cow) > self.pool.num_free:
            return False
        fresh = self._take(num_new + len(cow))
        for i, new in zip(cow, fresh):
            old = seq.blocks[i]
            if self.storage is not None:
                self.storage.copy_block(old.block_id, new.block_id)
            seq.blocks[i] = new
            self.pool.release(old)             # ref was > 1: the other holders keep it
        seq.blocks.extend(fresh[len(cow):])
        self._stats.cow_copies += len(cow)
        if seq.pending_query is not None:
            self._stats.prefix_queried_tokens += seq.pending_query[0]
            self._stats.prefix_hit_tokens += seq.pending_query[1]
            seq.pending_query = None
        return True

    def commit(self, seq_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """The first num_computed_tokens of token_ids now have KV: hash and cache newly full blocks."""
        seq = self._get(seq_id)
        bs = self._block_size
        if not 0 <= num_computed_tokens <= min(len(token_ids), len(seq.blocks) * bs):
            raise ValueError(f"commit({seq_id!r}): {num_computed_tokens} computed tokens, but "
                             f"{len(token_ids)} token ids and {len(seq.blocks) * bs} slots")
        seq.num_computed = num_computed_tokens
        if not self.enable_prefix_caching:
            return
        num_full = num_computed_tokens // bs     # a partially filled block is cached once it fills
        for i in range(seq.num_hashed, num_full):
            block = seq.blocks[i]
            toks = tuple(token_ids[i * bs:(i + 1) * bs])
            key = (seq.tip_id, toks, seq.salt)
            if block.block_hash is not None:
                # Already cached through another holder of this shared block (fork before commit):
                # its entry is authoritative for the content, so adopt it as the chain tip.
                assert block.key is not None and block.key[1:] == key[1:], "shared block committed with different tokens"
                h, entry_id = block.block_hash, block.entry_id
            else:
                h = block_pool.hash_block(seq.tip_hash, toks, seq.salt)
                found = self._find(h)
                if found is None:
                    entry_id = self._new_entry_id()
                    self.pool.cache(block, h, key, entry_id)
                elif found[0] == key:
                    # Same content cached by another block (computed concurrently): keep that entry,
                    # leave this block uncached, and chain on under the existing entry's id.
                    entry_id = found[1]
                else:
                    # A real hash collision: cache nothing; the id below is never registered, so
                    # no lookup can ever match a block chained under it.
                    entry_id = self._new_entry_id()
            seq.tip_hash, seq.tip_id = h, entry_id
        seq.num_hashed = max(seq.num_hashed, num_full)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent (ref + 1) and copies its chain state."""
        if child_id in self._seqs:
            raise ValueError(f"fork: sequence {child_id!r} already exists")
        parent = self._get(parent_id)
        for block in parent.blocks:
            self.pool.touch(block)
        self._seqs[child_id] = replace(parent, blocks=list(parent.blocks), pending_query=None)

    def free(self, seq_id: str) -> None:
        """Release a sequence's blocks, tail first; unknown ids are a no-op."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        # Tail first: the free list is LRU, so a chain's tail is evicted before its head
        # (a head block is worth more: every longer prefix needs it).
        for block in reversed(seq.blocks):
            self.pool.release(block)

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Speculative decoding rolled back: keep the blocks covering ``num_tokens`` tokens and
        release the rest (tail first). Only blocks past every committed (hashed) block go."""
        seq = self._get(seq_id)
        keep = -(-num_tokens // self._block_size)
        assert keep >= seq.num_hashed, f"truncate({seq_id!r}) would drop committed blocks"
        while len(seq.blocks) > keep:
            self.pool.release(seq.blocks.pop())
        seq.num_computed = min(seq.num_computed, num_tokens)

    def block_table(self, seq_id: str) -> list[int]:
        return [b.block_id for b in self._get(seq_id).blocks]

    def stats(self) -> KVCacheStats:
        """A snapshot (a copy): safe to hand to the metrics thread."""
        return replace(self._stats, num_used_blocks=self.num_blocks - self.pool.num_free)

    def check_integrity(self) -> None:
        """Assert: every block free xor referenced; ref counts == number of tables holding it;
        hash map and free list agree."""
        self.pool.check()
        holders = [0] * self.num_blocks
        for seq_id, seq in self._seqs.items():
            ids = [b.block_id for b in seq.blocks]
            assert len(ids) == len(set(ids)), f"{seq_id}: block twice in one table"
            assert seq.num_hashed <= len(seq.blocks) and seq.num_computed <= len(seq.blocks) * self._block_size
            for i in ids:
                holders[i] += 1
        for block in self.pool.blocks:
            assert block.ref_cnt == holders[block.block_id], \
                f"block {block.block_id}: ref {block.ref_cnt}, held by {holders[block.block_id]} tables"
        if self._tiered:
            self.offload.check()
            assert not set(self.offload.hashes()) & set(self.pool.cached), "hash both on device and offloaded"

    # -- internals -------------------------------------------------------------------------
    def _get(self, seq_id: str) -> _Seq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id!r} (call acquire_prefix first)")
        return seq

    def _plan(self, seq: _Seq, num_tokens: int) -> tuple[int, list[int]]:
        """New blocks needed, and indices of shared blocks that the next write would touch."""
        bs = self._block_size
        needed = -(-num_tokens // bs)
        first_written = seq.num_computed // bs
        cow = [i for i in range(first_written, min(needed, len(seq.blocks))) if seq.blocks[i].ref_cnt > 1]
        return max(0, needed - len(seq.blocks)), cow

    def _match(self, token_ids: list[int], salt: str | None) -> list[_Hit]:
        """Walk the hash chain through the device map and the tiers; stop at the first miss.
        Never covers the last token: the model must compute at least one position for logits."""
        if not self.enable_prefix_caching:
            return []
        bs, hits = self._block_size, []
        tip_hash, tip_id = ROOT_HASH, ROOT_ID
        for i in range(max(0, len(token_ids) - 1) // bs):
            toks = tuple(token_ids[i * bs:(i + 1) * bs])
            key = (tip_id, toks, salt)
            h = block_pool.hash_block(tip_hash, toks, salt)
            found = self._find(h)
            if found is None or found[0] != key:   # exact check: a colliding hash is a miss
                break
            hits.append(_Hit(h, key, found[1], self.pool.cached.get(h)))
            tip_hash, tip_id = h, found[1]
        return hits

    def _find(self, block_hash: bytes) -> tuple[CacheKey, int] | None:
        """(key, entry id) of the entry cached under this hash anywhere, device first."""
        block = self.pool.cached.get(block_hash)
        if block is not None:
            assert block.key is not None, "a cached block has its key"
            return block.key, block.entry_id
        found = self.offload.find(block_hash) if self._tiered else None
        return None if found is None else (found[1].key, found[1].entry_id)

    def _take(self, n: int) -> list[KVCacheBlock]:
        """n fresh blocks; evicted cached blocks go to the offload tiers (content copied first)."""
        blocks, evicted = self.pool.take(n)
        self._stats.evictions += len(evicted)
        if evicted and self._tiered:
            contents = None
            if self.storage is not None:
                contents = self.storage.read_blocks([e.block_id for e in evicted])
            for j, e in enumerate(evicted):
                self.offload.put(e.block_hash, e.key, e.entry_id, None if contents is None else contents[j])
            self._stats.offload_out_blocks += len(evicted)
            self._stats.offload_out_bytes += len(evicted) * self._block_bytes
        return blocks

    def _new_entry_id(self) -> int:
        self._next_entry_id += 1
        return self._next_entry_id - 1
