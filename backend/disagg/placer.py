"""The decode role's placer: a thread that fetches large hand-overs' KV and writes it into blocks
the engine thread allocated, so a big copy never lengthens a decode step (decode.py says when)."""
from __future__ import annotations

import queue
import threading
import time

from backend.disagg.connector import KVConnector, TransferError


PLACER_THREAD = "kv-admit"          # the placer thread's name (also at the OS level, for apply_layout)


class Job:
    """One record's fetch + KV write on the placer thread."""
    __slots__ = ("rec", "req", "seq", "first", "block_ids", "done", "error", "seconds", "aborted")

    def __init__(self, rec, req, seq, first: int, block_ids: list[int]) -> None:
        # req.salt is the caller's: the owner the fetch names (never the record's)
        self.rec, self.req, self.seq, self.first, self.block_ids = rec, req, seq, first, block_ids
        self.done = threading.Event()
        self.error: Exception | None = None
        self.seconds = 0.0
        self.aborted = False                        # engine thread only


class KVPlacer:
    """A thread that fetches hand-overs' KV and writes it into blocks the engine thread allocated.
    It touches no engine state but those blocks' storage; everything else (allocation, commit,
    scheduling, freeing) stays on the engine thread. Started at once (it exists before the
    server's threads are placed) and named at the OS level (``PLACER_THREAD``)."""

    def __init__(self, connector: KVConnector, storage) -> None:
        self.connector = connector
        self.storage = storage
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=PLACER_THREAD, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._q.put(job)

    def close(self) -> None:
        self._q.put(None)

    def _run(self) -> None:
        try:
            with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
                f.write(PLACER_THREAD)
        except OSError:
            pass
        while True:
            job = self._q.get()
            if job is None:
                return
            t0 = time.perf_counter()
            try:
                rec = job.rec
                data = self.connector.fetch(rec.locator, job.first, rec.num_blocks - job.first,
                                            owner=job.req.salt or "")
                self.storage.write_blocks(job.block_ids, data)
                del data                            # shm: unmapped here, off the decode core
            except TransferError as exc:
                job.error = exc
            except Exception as exc:                # noqa: BLE001 - any failure: recompute
                job.error = TransferError(f"{type(exc).__name__}: {exc}")
            job.seconds = time.perf_counter() - t0
            job.done.set()
