"""The KV connector interface: how a request's KV blocks get from a prefill pool to a decode pool.

Pull model, in three calls::

    loc = conn.stage(transfer_id, blocks)          # prefill side, right after the first token:
                                                   #   blocks = [n, layers, 2, block_size, heads, dim]
                                                   #   (KVCacheStorage.read_blocks); the prefill
                                                   #   pool's blocks are free again on return
    data = conn.fetch(loc, first_block, count)     # decode side, once it has allocated blocks:
                                                   #   only blocks it does not already hold
                                                   #   (its prefix-cache hits are never moved)
    conn.discard(data)                             # decode side, once written: free it (off the step)
    conn.release(loc)                              # either side: drop what is staged (idempotent)

``fetch`` consumes the staged data (a transfer is read once). It raises :class:`TransferError`
on any failure (peer gone, dropped mid-way, size mismatch); the decode side then recomputes the
prompt itself, so a failed transfer costs time, never a wrong answer.
"""
from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

import torch


class TransferError(RuntimeError):
    """A KV transfer failed; the caller falls back to recomputing."""


@dataclass
class TransferStats:
    """Monotonic counters; ``snapshot()`` copies them for the metrics thread."""
    staged: int = 0
    staged_bytes: int = 0
    fetched: int = 0
    fetched_bytes: int = 0           # bytes that crossed to the decode side
    skipped_blocks: int = 0          # staged blocks the decode side already had (prefix hits)
    failed: int = 0
    released: int = 0
    expired: int = 0                 # staged transfers dropped by the TTL (never fetched nor released)
    stage_seconds: float = 0.0
    fetch_seconds: float = 0.0


class KVConnector(ABC):
    kind = "abstract"

    def __init__(self) -> None:
        self._stats = TransferStats()
        self._lock = threading.Lock()      # stats are bumped from server threads too

    @abstractmethod
    def _stage(self, transfer_id: str, blocks: torch.Tensor) -> dict: ...

    @abstractmethod
    def _fetch(self, locator: dict, first_block: int, count: int) -> torch.Tensor: ...

    @abstractmethod
    def release(self, locator: dict) -> None: ...

    def stage(self, transfer_id: str, blocks: torch.Tensor) -> dict:
        t0 = time.perf_counter()
        loc = self._stage(transfer_id, blocks.contiguous())
        loc.update(kind=self.kind, shape=list(blocks.shape), dtype=str(blocks.dtype).removeprefix("torch."))
        self._count(staged=1, staged_bytes=blocks.numel() * blocks.element_size(),
                    stage_seconds=time.perf_counter() - t0)
        return loc

    def fetch(self, locator: dict, first_block: int, count: int) -> torch.Tensor:
        """Blocks [first_block, first_block + count) of a staged transfer, then released."""
        if locator.get("kind") != self.kind:
            raise TransferError(f"locator of a {locator.get('kind')!r} connector given to {self.kind!r}")
        total = locator["shape"][0]
        if not (0 <= first_block and count >= 0 and first_block + count <= total):
            self.release(locator)
            raise TransferError(f"blocks [{first_block}, {first_block + count}) out of {total} staged")
        t0 = time.perf_counter()
        try:
            data = self._fetch(locator, first_block, count)
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
            for k, v in inc.items():
                setattr(self._stats, k, getattr(self._stats, k) + v)


def make_connector(args) -> KVConnector:
    """The connector EngineArgs name (kv_connector, kv_connector_host / _port for tcp)."""
    if args.kv_connector == "shm":
        from backend.disagg.shm import SharedMemoryConnector
        return SharedMemoryConnector()
    from backend.disagg.tcp import TcpConnector
    return TcpConnector(args.kv_connector_host, args.kv_connector_port)
