"""Decode role: take a hand-over into this engine's own KV pool and continue the stream.

``DecodeRole(engine, connector)``; the router calls ``submit(record)`` and, before each engine
step, ``admit_pending()``, which for each record in arrival order:

  1. rebuilds the request (prompt + first token, its stop/stream state, a seeded choice's
     generator) and validates it against *this* engine's limits;
  2. attaches this pool's cached prefix blocks (the hash chain is the same on both sides), then
     allocates blocks for the rest of the prompt: no room = the record waits for the next step
     (its KV stays staged) rather than making the decode engine prefill;
  3. fetches only the blocks it does not hold, writes them, commits them to its prefix cache
     and marks the prompt computed, so the next step decodes the first token's successor;
  4. returns the first token's delta (TTFT includes the hand-over).

Large hand-overs off the step path (``placer``, a ``KVPlacer``; the decode server uses one): step 2
runs on the engine thread, but the fetch and the KV write of a record of at least
``async_min_blocks`` blocks run on the placer's own thread while the engine keeps stepping (the
blocks are allocated to the request and not in the scheduler yet, so no step reads them); a later
``admit_pending`` collects it (commit, schedule, first token). ``serve --disagg`` pins that thread
to the prefill CPUs (``apply_layout``), so a 512-token prompt's 7 MB copy and its page faults no
longer lengthen one decode step by 4-7 ms. An abort meanwhile ends the stream at once and frees the
blocks when the write is done.

A record whose KV is unusable (transfer failed, nothing staged, pool shape differs) is admitted
as an ordinary waiting request carrying its first token: this engine recomputes the prompt, so
the output is the same, only later. Never a wrong answer: no KV is written unless the whole
fetched range arrived with the expected shape (and, over TCP, its MAC).

The record is not trusted: the caller validates it (``Handover.validate``) before ``submit``, and
``submit`` takes the request's salt and priority from the caller's own request, never from the
record; the salt is the owner the connector checks the transfer against (another tenant's
transfer is refused and left staged) and the prefix-cache salt of the blocks committed here.
A record that still fails here ends that request with an error, never the engine thread.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from backend.disagg.connector import KVConnector, KVGeometry, TransferError
from backend.disagg.handover import Handover
from backend.disagg.placer import KVPlacer, Job
from backend.engine.admission import duplicate_id, validate_request
from backend.outputs import make_deltas
from backend.engine.sequence import Request
from backend.errors import EngineError, internal
from backend.outputs import StepDelta


@dataclass
class DecodeStats:
    admitted: int = 0               # with transferred KV
    recomputed: int = 0             # fallback: the prompt was computed again here
    rejected: int = 0               # failed this engine's validation
    aborted_pending: int = 0
    fetched_blocks: int = 0
    prefix_hit_blocks: int = 0      # blocks not fetched because this pool had them
    fetch_seconds: float = 0.0
    placed_async: int = 0           # of admitted + recomputed: fetched and written by the placer


ASYNC_MIN_BLOCKS = 8                # fetch + write of records this large go to the placer (128 tokens)


class DecodeRole:
    def __init__(self, engine, connector: KVConnector, placer: KVPlacer | None = None,
                 async_min_blocks: int = ASYNC_MIN_BLOCKS):
        self.engine = engine
        self.connector = connector
        self.pending: dict[str, Handover] = {}       # insertion order = arrival order
        self.stats = DecodeStats()
        self.placer = placer
        self.async_min_blocks = async_min_blocks     # bench A/B: a huge value = all inline
        self.placing: dict[str, Job] = {}           # on the placer, in submission order
        # request id -> the caller's own (salt, priority, deadline): never the record's
        self.callers: dict[str, tuple[str | None, int, float | None]] = {}
        connector.set_geometry(KVGeometry.of_engine(engine))  # every locator is checked against this pool

    def busy(self) -> bool:
        """Records not admitted yet, or being placed."""
        return bool(self.pending) or bool(self.placing)

    def holds(self, request_id: str) -> bool:
        return request_id in self.pending or request_id in self.placing

    def submit(self, record: Handover, *, salt: str | None = None, priority: int = 0,
               deadline: float | None = None) -> None:
        """Queue a validated record; ``salt``, ``priority`` and ``deadline`` (time.monotonic())
        are the caller's own request's (the record's remaining time can only shorten it)."""
        self.pending[record.request_id] = record
        self.callers[record.request_id] = (salt, priority, deadline)

    def abort(self, request_id: str) -> list[StepDelta] | None:
        """Abort a hand-over not admitted yet (its staged KV is dropped; one being placed frees
        its blocks once the placer is done with them); None if not pending."""
        job = self.placing.get(request_id)
        if job is not None and not job.aborted:
            job.aborted = True
            self.stats.aborted_pending += 1
            return [_final(job.rec, "abort", None)]
        rec = self.pending.pop(request_id, None)
        if rec is None:
            return None
        self._drop(rec, self.callers.pop(request_id, (None, 0, None))[0])
        self.stats.aborted_pending += 1
        return [_final(rec, "abort", None)]

    def admit_pending(self, limit: int | None = None) -> list[StepDelta]:
        """Admit pending records in arrival order; at most ``limit`` per call (each costs a fetch
        and a KV write before the next decode step: a burst spread over steps keeps ITL even)."""
        deltas = self.collect() if self.placing else []
        for rid in list(self.pending)[:limit]:
            rec = self.pending[rid]
            salt, priority, deadline = self.callers.get(rid, (None, 0, None))
            try:
                out = self._admit(rec, salt, priority, deadline)
            except Exception as exc:                  # noqa: BLE001 - a bad record ends its request, not the engine
                self._abandon(rec, salt)
                self.stats.rejected += 1
                out = [_final(rec, "error", internal(f"bad hand-over: {type(exc).__name__}: {exc}"))]
            if out is None:
                break                                 # no room: keep order, retry next step
            del self.pending[rid]
            self.callers.pop(rid, None)
            deltas += out
        return deltas

    def collect(self) -> list[StepDelta]:
        """Records the placer finished: schedule them (KV written) or recompute (transfer
        failed); an aborted one only frees its blocks."""
        eng, sched, kv = self.engine, self.engine.scheduler, self.engine.kv
        deltas: list[StepDelta] = []
        for rid, job in list(self.placing.items()):
            if not job.done.is_set():
                break                                 # one FIFO thread: the rest are later
            del self.placing[rid]
            seq = job.seq
            if job.aborted:
                kv.free(seq.seq_id)
                self._drop(job.rec, job.req.salt)
                continue
            if job.error is not None:
                kv.free(seq.seq_id)
                self._drop(job.rec, job.req.salt)
                self.stats.recomputed += 1
                sched.add_request(job.req)
            else:
                self._placed(job.rec, seq, job.first)
                self.stats.fetch_seconds += job.seconds
                sched.add_request(job.req, computed=True)
                self.stats.admitted += 1
            deltas += make_deltas([seq], eng.stop_checker)
        return deltas

    def wait_placing(self, timeout: float) -> None:
        """Nothing else to do: wait (at most ``timeout`` s) for the oldest placement."""
        for job in self.placing.values():
            job.done.wait(timeout)
            return

    # -- one record ---------------------------------------------------------------------------
    def _abandon(self, rec: Handover, salt: str | None) -> None:
        """A record that failed on the engine thread: free what it may hold here (unless its id
        is a running request's) and release its staged KV."""
        if rec.request_id not in self.engine.scheduler.requests and rec.request_id not in self.placing:
            self.engine.kv.free(f"{rec.request_id}#0")          # Sequence.seq_id of choice 0; unknown: no-op
        self._drop(rec, salt)

    def _admit(self, rec: Handover, salt: str | None, priority: int,
               deadline: float | None = None) -> list[StepDelta] | None:
        eng, sched, kv = self.engine, self.engine.scheduler, self.engine.kv
        try:
            params = rec.sampling_params()
            max_tokens = validate_request(eng.limits, rec.request_id, rec.prompt_token_ids, params)
            if rec.request_id in sched.requests:
                raise duplicate_id(rec.request_id)
        except (EngineError, ValueError, TypeError) as exc:
            self._drop(rec, salt)
            self.stats.rejected += 1
            err = exc if isinstance(exc, EngineError) else internal(f"bad hand-over: {exc}")
            return [_final(rec, "error", err)]
        if len(sched.running) + len(self.placing) + 1 > eng.config.max_num_seqs:
            return None
        now = time.monotonic()
        ends = [d for d in (deadline, None if rec.deadline_in is None else now + rec.deadline_in) if d is not None]
        req = Request(rec.request_id, list(rec.prompt_token_ids), params, max_tokens=min(max_tokens, rec.max_tokens),
                      stream=rec.stream, salt=salt, priority=priority, deadline=min(ends, default=None),
                      arrival_time=now - rec.queue_time)
        req.first_scheduled_time = req.first_token_time = now
        req.num_cached_tokens = rec.num_cached_tokens
        seq = req.seqs[0]
        gen = rec.generator()
        if gen is not None:
            seq.generator = gen                     # seeded sampling continues where prefill left it
        seq.token_ids.append(rec.first_token)
        lp = rec.logprob()
        if lp is not None:
            seq.logprobs.append(lp)
        eng.stop_checker.check(seq, rec.first_token)   # stream state (held stop-string text)
        if seq.finish_reason is not None:            # cannot happen with the same params; be safe
            self._drop(rec, salt)
            seq.status = seq.status.FINISHED
            return make_deltas([seq], eng.stop_checker)

        why = rec.check(vocab_size=eng.vocab_size, block_size=kv.block_size,
                        block_shape=kv.storage.block_shape, dtype=kv.storage.dtype)
        if why is None and rec.locator is not None:
            placed = self._place(rec, seq, req)
            if placed is None:
                return None                         # no room yet; nothing changed
            if placed == "async":
                return []                           # collect() schedules it once written
            if placed:
                sched.add_request(req, computed=True)
                self.stats.admitted += 1
                return make_deltas([seq], eng.stop_checker)
        # Fallback: recompute the prompt here (the first token stays; the next one is sampled
        # after the recomputed prompt + first token, exactly as a unified engine would).
        self._drop(rec, salt)
        self.stats.recomputed += 1
        sched.add_request(req)
        return make_deltas([seq], eng.stop_checker)

    def _place(self, rec: Handover, seq, req) -> bool | str | None:
        """Allocate, fetch and write the prompt's KV. True = done; False = transfer failed
        (nothing held); None = no room (nothing held, the KV stays staged); "async" = the
        blocks are allocated and the placer fetches and writes them (``collect``)."""
        kv = self.engine.kv
        n = rec.num_kv_tokens
        cached = kv.acquire_prefix(seq.seq_id, rec.prompt_token_ids, req.salt)
        if cached is None:
            return None
        if not kv.allocate_slots(seq.seq_id, n):
            kv.free(seq.seq_id)
            return None
        first = cached // kv.block_size
        if (self.placer is not None and rec.num_blocks - first >= self.async_min_blocks
                and self.engine.has_unfinished()):  # streams to keep even; else inline is sooner
            job = Job(rec, req, seq, first, kv.block_table(seq.seq_id)[first:rec.num_blocks])
            self.placing[rec.request_id] = job
            self.stats.placed_async += 1
            self.placer.submit(job)
            return "async"
        t0 = time.perf_counter()
        try:
            data = self.connector.fetch(rec.locator, first, rec.num_blocks - first, owner=req.salt or "")
        except TransferError:
            kv.free(seq.seq_id)
            return False
        self.stats.fetch_seconds += time.perf_counter() - t0
        table = kv.block_table(seq.seq_id)
        kv.storage.write_blocks(table[first:rec.num_blocks], data)
        self.connector.discard(data)                  # shm: unmapped on its releaser thread
        del data
        self._placed(rec, seq, first)
        return True

    def _placed(self, rec: Handover, seq, first: int) -> None:
        """The prompt's KV is in this pool: commit it and mark the prompt computed."""
        n = rec.num_kv_tokens
        self.engine.kv.commit(seq.seq_id, seq.token_ids, n)   # the prompt's full blocks join this prefix cache
        seq.num_computed_tokens = seq.high_water = n
        self.stats.fetched_blocks += rec.num_blocks - first
        self.stats.prefix_hit_blocks += first

    def _drop(self, rec: Handover, salt: str | None) -> None:
        """Release the record's staged KV, on behalf of the caller (another owner's stays)."""
        if rec.locator is not None:
            self.connector.release(rec.locator, owner=salt or "")


def _final(rec: Handover, reason: str, error: EngineError | None) -> StepDelta:
    """The final delta of a hand-over that never became a request here."""
    return StepDelta(request_id=rec.request_id, index=0, new_token_ids=[], window_ids=[], num_sent=0,
                     finished=True, finish_reason=reason, error=error,
                     prompt_tokens=len(rec.prompt_token_ids), cached_tokens=rec.num_cached_tokens,
                     queue_time=rec.queue_time)
