"""Offload tiers below the device pool: host memory, then optionally a disk file.

    device pool --evict--> host tier --evict--> disk tier --evict--> dropped
         ^                     |                    |
         +------ swap-in ------+--------------------+   (on a prefix hit)

Each tier is an LRU map ``hash -> (slot, key, entry_id)`` over a fixed array of block slots.
Tiers are exclusive: a hash lives in exactly one place (device or one tier) at a time, so a
swap-in *moves* the entry back to the device. Nothing in a tier is ever in use, so a tier can
always make room by pushing its oldest entry down (or dropping it at the last tier).
"""
from __future__ import annotations

import os
import tempfile
from collections import OrderedDict
from dataclasses import dataclass

import torch

from backend.kv_cache.block_pool import CacheKey


@dataclass
class TierEntry:
    key: CacheKey
    entry_id: int
    slot: int


class OffloadTier:
    """One LRU level. ``data`` is [capacity, *block_shape], or None when there is no storage
    (allocator-only use: metadata moves, contents do not)."""

    def __init__(self, name: str, capacity: int, data: torch.Tensor | None,
                 next_tier: OffloadTier | None = None):
        self.name, self.capacity, self.data, self.next_tier = name, capacity, data, next_tier
        self.entries: OrderedDict[bytes, TierEntry] = OrderedDict()   # oldest first
        self._free_slots = list(range(capacity - 1, -1, -1))
        self.dropped = 0   # entries that fell off the last tier

    def get(self, block_hash: bytes) -> TierEntry | None:
        return self.entries.get(block_hash)

    def put(self, block_hash: bytes, key: CacheKey, entry_id: int, block: torch.Tensor | None) -> None:
        """Store one block's content (``block``: [*block_shape]); the oldest entry moves down if full."""
        assert block_hash not in self.entries
        if not self._free_slots:
            self._demote_oldest()
        slot = self._free_slots.pop()
        if self.data is not None and block is not None:
            self.data[slot].copy_(block)
        self.entries[block_hash] = TierEntry(key, entry_id, slot)

    def pop(self, block_hash: bytes) -> tuple[TierEntry, torch.Tensor | None]:
        """Remove an entry and return it with a private copy of its content (the slot is reused)."""
        entry = self.entries.pop(block_hash)
        self._free_slots.append(entry.slot)
        content = None if self.data is None else self.data[entry.slot].clone()
        return entry, content

    def _demote_oldest(self) -> None:
        h, entry = self.entries.popitem(last=False)
        if self.next_tier is not None:
            block = None if self.data is None else self.data[entry.slot]
            self.next_tier.put(h, entry.key, entry.entry_id, block)   # copies before the slot is reused
        else:
            self.dropped += 1
        self._free_slots.append(entry.slot)

    def check(self) -> None:
        slots = [e.slot for e in self.entries.values()]
        assert len(slots) + len(self._free_slots) == self.capacity, f"{self.name}: slot count mismatch"
        assert len(set(slots) | set(self._free_slots)) == self.capacity, f"{self.name}: slot used twice"


class OffloadChain:
    """The tiers in order; the first receives device evictions."""

    def __init__(self, *, block_shape: tuple[int, ...] | None, dtype: torch.dtype, pin_memory: bool,
                 host_blocks: int, disk_path: str | None, disk_blocks: int):
        self.tiers: list[OffloadTier] = []
        if disk_blocks > 0:
            if disk_path is None:
                raise ValueError("disk_tier_blocks > 0 needs disk_tier_path")
            data = None if block_shape is None else _file_backed(disk_path, disk_blocks, block_shape, dtype)
            self.tiers.append(OffloadTier("disk", disk_blocks, data))
        if host_blocks > 0:
            data = None
            if block_shape is not None:
                data = torch.zeros(host_blocks, *block_shape, dtype=dtype, pin_memory=pin_memory)
            self.tiers.insert(0, OffloadTier("host", host_blocks, data, self.tiers[0] if self.tiers else None))

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def find(self, block_hash: bytes) -> tuple[OffloadTier, TierEntry] | None:
        for tier in self.tiers:
            entry = tier.get(block_hash)
            if entry is not None:
                return tier, entry
        return None

    def put(self, block_hash: bytes, key: CacheKey, entry_id: int, block: torch.Tensor | None) -> None:
        self.tiers[0].put(block_hash, key, entry_id, block)

    def pop(self, block_hash: bytes) -> tuple[TierEntry, torch.Tensor | None]:
        found = self.find(block_hash)
        assert found is not None, "pop of a hash no tier holds"
        return found[0].pop(block_hash)

    def hashes(self) -> list[bytes]:
        return [h for tier in self.tiers for h in tier.entries]

    def check(self) -> None:
        for tier in self.tiers:
            tier.check()
        hashes = self.hashes()
        assert len(hashes) == len(set(hashes)), "a hash is in two offload tiers"


def _file_backed(path: str, capacity: int, block_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A scratch tensor mapped from a file of our own: created (in ``path`` if it is a directory,
    else as ``path``, which must not exist yet), fully allocated, mapped, then unlinked, so
    nothing is left on disk after exit and no stale content can be read.

    * The space is reserved up front (``posix_fallocate``): a full disk is a clear error here,
      never a SIGBUS later when a page of a sparse mapping cannot be backed.
    * An existing file the operator named is never truncated, overwritten or unlinked.
    """
    numel = capacity
    for d in block_shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    try:
        if os.path.isdir(path):
            fd, path = tempfile.mkstemp(prefix="kv_offload_", suffix=".bin", dir=path)
        elif os.path.lexists(path):
            raise ValueError(f"disk_tier_path {path!r} is an existing file: give a directory (the disk "
                             "tier never overwrites or deletes a file it did not create)")
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise ValueError(f"disk_tier_path {path!r} is not usable for the KV disk tier: {exc}") from None
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            raise ValueError(f"the KV disk tier needs {nbytes / 2**20:.0f} MiB at {path!r}: {exc} "
                             "(lower disk_tier_blocks or choose another disk_tier_path)") from None
        flat = torch.from_file(path, shared=True, size=numel, dtype=dtype)
    finally:
        os.close(fd)
        os.unlink(path)                     # ours: created above
    return flat.view(capacity, *block_shape)
