"""The KV connector interface: how a request's KV blocks get from a prefill pool to a decode pool.

Pull model, in three calls::

    loc = conn.stage(blocks, owner=salt)           # prefill side, right after the first token:
                                                   #   blocks = [n, layers, 2, block_size, heads, dim]
                                                   #   (KVCacheStorage.read_blocks); the prefill
                                                   #   pool's blocks are free again on return
    data = conn.fetch(loc, first, count, owner=salt)   # decode side, once it has allocated blocks:
                                                   #   only blocks it does not already hold
                                                   #   (its prefix-cache hits are never moved)
    conn.discard(data)                             # decode side, once written: free it (off the step)
    conn.release(loc, owner=salt)                  # either side: drop what is staged (idempotent)

``fetch`` consumes the staged data (a transfer is read once). It raises :class:`TransferError`
on any failure (peer gone, dropped mid-way, size mismatch); the decode side then recomputes the
prompt itself, so a failed transfer costs time, never a wrong answer.

A transfer's id is 128 random bits (``new_transfer_id``), unrelated to the request id. It belongs
to its ``owner`` (the staging request's prefix-cache salt, i.e. its tenant): a fetch or release
on behalf of another owner is refused as if the transfer did not exist, and leaves it staged.
``release`` without ``owner`` is the staging side dropping its own transfer. Every locator is
checked (``check_locator``) against the fetching pool's geometry (``set_geometry``) before a byte
is allocated.
"""
from __future__ import annotations

import hashlib
import math
import re
import secrets
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

import torch


class TransferError(RuntimeError):
    """A KV transfer failed; the caller falls back to recomputing."""


TRANSFER_ID = re.compile(r"[0-9a-f]{32}")
KV_DTYPES = ("float32", "float16", "bfloat16")
MAX_FETCH_BYTES = 1 << 32            # without a geometry: no single fetch above 4 GiB


def new_transfer_id() -> str:
    return secrets.token_hex(16)


def owner_tag(owner: str | None) -> str:
    """What travels for an owner (salt): a digest, so a tenant's name is not on the wire."""
    return hashlib.sha256(b"llmkv-owner\0" + (owner or "").encode()).hexdigest()


@dataclass(frozen=True)
class KVGeometry:
    """What the fetching pool can take: one block's shape [layers, 2, block_size, kv_heads,
    head_dim], its dtype name, and the most blocks one request can have."""
    block_shape: tuple[int, ...]
    dtype: str
    max_blocks: int

    @classmethod
    def of_engine(cls, engine) -> "KVGeometry | None":
        kv = engine.kv
        if kv.storage is None:
            return None
        return cls(tuple(kv.storage.block_shape), str(kv.storage.dtype).removeprefix("torch."),
                   -(-engine.limits.max_model_len // kv.block_size))


def _int(v, lo: int, hi: int, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise TransferError(f"{what} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def check_locator(locator, first_block, count, geometry: KVGeometry | None,
                  max_bytes: int = MAX_FETCH_BYTES) -> tuple[list[int], str, int]:
    """(shape, dtype name, bytes to fetch) of a locator that fits ``geometry``; TransferError
    otherwise. Runs before anything is allocated or any connection made."""
    if not isinstance(locator, dict):
        raise TransferError("locator is not an object")
    shape, dtype = locator.get("shape"), locator.get("dtype")
    if not isinstance(shape, list) or len(shape) != 6:
        raise TransferError(f"locator shape must be 6 integers, got {shape!r}")
    hi = geometry.max_blocks if geometry is not None else 1 << 20
    _int(shape[0], 1, hi, "locator block count")
    for d in shape[1:]:
        _int(d, 1, 1 << 20, "locator block dimension")
    if dtype not in KV_DTYPES:
        raise TransferError(f"locator dtype must be one of {', '.join(KV_DTYPES)}, got {dtype!r}")
    if geometry is not None and (tuple(shape[1:]) != geometry.block_shape or dtype != geometry.dtype):
        raise TransferError(f"locator blocks {shape[1:]} {dtype} differ from this pool's "
                            f"{list(geometry.block_shape)} {geometry.dtype}")
    _int(first_block, 0, shape[0], "first block")
    _int(count, 0, shape[0] - first_block, "block count")
    nbytes = count * math.prod(shape[1:]) * (4 if dtype == "float32" else 2)
    if nbytes > max_bytes:
        raise TransferError(f"a fetch of {nbytes} bytes exceeds {max_bytes}")
    return shape, dtype, nbytes


@dataclass
class TransferStats:
    """Monotonic counters; ``snapshot()`` copies them for the metrics thread."""
    staged: int = 0
    staged_bytes: int = 0
    fetched: int = 0
    fetched_bytes: int = 0           # bytes that crossed to the decode side
    skipped_blocks: int = 0          # staged blocks the decode side already had (prefix hits)
    failed: int = 0
    refused: int = 0                 # fetches / releases refused: unknown transfer, other owner, bad locator
    auth_failures: int = 0           # connections that did not prove the secret (TCP server)
    rx_alloc_bytes: int = 0          # bytes allocated for what peers sent (TCP fetch payloads)
    released: int = 0
    expired: int = 0                 # staged transfers dropped by the TTL (never fetched nor released)
    stage_seconds: float = 0.0
    fetch_seconds: float = 0.0


class KVConnector(ABC):
    kind = "abstract"

    def __init__(self) -> None:
        self._stats = TransferStats()
        self._lock = threading.Lock()      # stats are bumped from server threads too
        self.geometry: KVGeometry | None = None

    def set_geometry(self, geometry: KVGeometry | None) -> None:
        """The fetching pool's KV geometry: every locator is checked against it."""
        self.geometry = geometry

    @abstractmethod
    def _stage(self, transfer_id: str, blocks: torch.Tensor, owner: str) -> dict: ...

    @abstractmethod
    def _fetch(self, locator: dict, first_block: int, count: int, owner: str) -> torch.Tensor: ...

    @abstractmethod
    def release(self, locator: dict, owner: str | None = None) -> None: ...

    def stage(self, blocks: torch.Tensor, *, owner: str | None = None) -> dict:
        """Stage ``blocks`` for ``owner`` (a salt) under a fresh random transfer id."""
        t0 = time.perf_counter()
        loc = self._stage(new_transfer_id(), blocks.contiguous(), owner_tag(owner))
        loc.update(kind=self.kind, shape=list(blocks.shape), dtype=str(blocks.dtype).removeprefix("torch."))
        self._count(staged=1, staged_bytes=blocks.numel() * blocks.element_size(),
                    stage_seconds=time.perf_counter() - t0)
        return loc

    def fetch(self, locator: dict, first_block: int, count: int, *, owner: str | None = None) -> torch.Tensor:
        """Blocks [first_block, first_block + count) of a staged transfer of ``owner``, then released."""
        if not isinstance(locator, dict) or locator.get("kind") != self.kind:
            kind = locator.get("kind") if isinstance(locator, dict) else None
            raise TransferError(f"locator of a {kind!r} connector given to {self.kind!r}")
        try:
            check_locator(locator, first_block, count, self.geometry)
        except TransferError:
            self._count(refused=1)
            raise
        t0 = time.perf_counter()
        try:
            data = self._fetch(locator, first_block, count, owner_tag(owner))
        except TransferError:
            self._count(failed=1)
            raise
        except Exception as exc:             # anything else from the transport is a failed transfer too
            self._count(failed=1)
            raise TransferError(f"{type(exc).__name__}: {exc}") from exc
        want = (count, *locator["shape"][1:])
        if tuple(data.shape) != want:
            self._count(failed=1)
            raise TransferError(f"fetched shape {tuple(data.shape)}, expected {want}")
        self._count(fetched=1, fetched_bytes=data.numel() * data.element_size(), skipped_blocks=first_block,
                    fetch_seconds=time.perf_counter() - t0)
        return data

    def discard(self, data: torch.Tensor) -> None:
        """The caller is done with what ``fetch`` returned (written into its pool). The shm
        connector's data views a mapping: it is unmapped off the caller's thread."""

    def expire(self, ttl: float) -> int:
        """Drop what this side staged more than ``ttl`` seconds ago and nobody fetched or
        released (a decode side that never came back); returns how many were dropped."""
        return 0

    def num_staged(self) -> int:
        """Transfers this side staged that may still be waiting (an upper bound for shm: a
        segment another process fetched is only noticed by the next ``expire``)."""
        return 0

    def start_reaper(self, ttl: float, interval: float | None = None) -> None:
        """A daemon thread that calls ``expire(ttl)`` every ``interval`` (default ttl / 4, at
        most 1 s) until ``close()``; ``ttl <= 0`` disables it."""
        if ttl <= 0 or getattr(self, "_reaper", None) is not None:
            return
        self._reaper_stop = threading.Event()
        every = interval if interval is not None else min(1.0, ttl / 4)

        def run() -> None:
            while not self._reaper_stop.wait(every):
                try:
                    self.expire(ttl)
                except Exception:            # noqa: BLE001 - the reaper must survive a bad segment
                    pass

        self._reaper = threading.Thread(target=run, name="kv-staged-ttl", daemon=True)
        self._reaper.start()

    def stop_reaper(self) -> None:
        if getattr(self, "_reaper", None) is not None:
            self._reaper_stop.set()
            self._reaper = None

    def stats(self) -> TransferStats:
        with self._lock:
            return replace(self._stats)

    def close(self) -> None:
        """Stop servers / drop everything staged by this side."""

    def _count(self, **inc) -> None:
        with self._lock:
            self._bump(**inc)

    def _bump(self, **inc: int) -> None:
        """``_count`` with ``_lock`` already held (a removal and its count seen as one step)."""
        for k, v in inc.items():
            setattr(self._stats, k, getattr(self._stats, k) + v)
