"""Shared-memory KV connector: engines on one host.

``stage`` copies the blocks into a fresh POSIX shared-memory segment (/dev/shm) named after the
transfer; the locator carries the name. ``fetch`` maps the segment, copies only the requested
block range out (the decode side's prefix hits are not read) and unlinks it. One memcpy on each
side, no serialization; the segment outlives the prefill engine's blocks, so the prefill pool is
free as soon as the hand-over is staged.

Segments are named ``<prefix><uuid>``, so a crashed pair's leftovers in /dev/shm are easy to find.
Every attach is paired with an unlink on the same handle: Python 3.11's resource tracker registers
a segment on attach and unregisters it on unlink, so the two stay balanced in either process.
"""
from __future__ import annotations

import os
import time
import uuid
from multiprocessing import shared_memory

import torch

from backend.disagg.connector import KVConnector, TransferError
from backend.disagg.handover import parse_dtype


class SharedMemoryConnector(KVConnector):
    kind = "shm"

    def __init__(self, prefix: str = "llmkv_"):
        super().__init__()
        self.prefix = prefix
        # staged by this process and not known fetched/released -> time.monotonic() of staging
        self._owned: dict[str, float] = {}

    def _stage(self, transfer_id: str, blocks: torch.Tensor) -> dict:
        nbytes = blocks.numel() * blocks.element_size()
        name = f"{self.prefix}{uuid.uuid4().hex[:20]}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=max(1, nbytes))
        try:
            if nbytes:
                dst = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)
                dst.copy_(blocks.reshape(-1).view(torch.uint8))
                del dst                      # no exported pointer may outlive close()
        except BaseException:
            shm.close()
            shm.unlink()
            raise
        shm.close()                          # the segment stays until unlinked
        self._owned[name] = time.monotonic()
        return {"name": name, "transfer_id": transfer_id}

    def _check_name(self, name) -> str:
        """Only our own segments: a bad record must not reach Triton's or anyone else's."""
        if not (isinstance(name, str) and name.startswith(self.prefix) and name[len(self.prefix):].isalnum()):
            raise TransferError(f"not a KV transfer segment name: {name!r}")
        return name

    def _fetch(self, locator: dict, first_block: int, count: int) -> torch.Tensor:
        name = self._check_name(locator["name"])
        try:
            shm = shared_memory.SharedMemory(name=name)
        except FileNotFoundError:
            raise TransferError(f"shared-memory segment {name} is gone (released or never staged)") from None
        try:
            dtype = parse_dtype(locator["dtype"])
            shape = locator["shape"]
            per_block = 1
            for d in shape[1:]:
                per_block *= d
            itemsize = torch.empty((), dtype=dtype).element_size()
            if shm.size < shape[0] * per_block * itemsize:
                raise TransferError(f"segment {name} has {shm.size} bytes, fewer than its locator says")
            src = torch.frombuffer(shm.buf, dtype=dtype, count=shape[0] * per_block)
            out = src[first_block * per_block:(first_block + count) * per_block].clone()
            del src
            return out.view(count, *shape[1:])
        finally:
            shm.close()
            shm.unlink()                      # a transfer is read once
            self._owned.pop(name, None)

    def release(self, locator: dict) -> None:
        if locator.get("kind") == self.kind and "name" in locator:
            try:
                name = self._check_name(locator["name"])
            except TransferError:
                return
            if self._unlink(name):
                self._count(released=1)

    def expire(self, ttl: float) -> int:
        now, n = time.monotonic(), 0
        for name, t in list(self._owned.items()):
            if now - t >= ttl and self._unlink(name):
                n += 1
        if n:
            self._count(expired=n)
        return n

    def num_staged(self) -> int:
        if os.path.isdir("/dev/shm"):             # drop the ones another process fetched meanwhile
            for name in list(self._owned):
                if not os.path.exists(f"/dev/shm/{name}"):
                    self._owned.pop(name, None)
        return len(self._owned)

    def close(self) -> None:
        self.stop_reaper()
        for name in list(self._owned):
            if self._unlink(name):
                self._count(released=1)

    def _unlink(self, name: str) -> bool:
        """True if the segment was still there (and is gone now)."""
        try:
            shm = shared_memory.SharedMemory(name=name)
        except FileNotFoundError:
            self._owned.pop(name, None)
            return False
        shm.close()
        shm.unlink()                          # also unregisters it from this process's tracker
        self._owned.pop(name, None)
        return True
