"""Drive a workload against a backend: fixed concurrency or Poisson arrivals, one record per turn.

    records, duration = asyncio.run(run_jobs(backend, jobs, concurrency=8))
    records, duration = asyncio.run(run_jobs(backend, jobs, request_rate=4.0, seed=0))

A job (a conversation) holds one concurrency slot for all its turns, so ``concurrency`` is the
number of streams in flight. With ``request_rate`` jobs start at seeded exponential gaps
(``inf`` = all at once), optionally capped by ``concurrency`` too.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time

from load.backends import Backend
from load.summary import RequestRecord
from load.workloads import Job, Turn


async def run_turn(backend: Backend, request_id: str, job: Job, turn_no: int, turn: Turn,
                   messages: list[dict], t_origin: float) -> tuple[RequestRecord, str]:
    """One streamed request; returns its record and the text it produced."""
    t0 = time.perf_counter()
    rec = RequestRecord(request_id, job.job_id, turn_no, start=t0 - t_origin)
    text: list[str] = []
    last = None
    counted = 0                             # tokens counted from pieces (HTTP: chunks)
    agen = backend.stream(request_id, messages, turn.max_tokens)
    try:
        async for piece in agen:
            now = piece.at or time.perf_counter()
            if piece.has_content:
                if rec.ttft is None:
                    rec.ttft = now - t0
                else:
                    rec.itl.append(now - last)
                last = now
                rec.chunks += 1
                counted += piece.tokens or 1
                text.append(piece.text)
            if piece.prompt_tokens is not None:
                rec.prompt_tokens = piece.prompt_tokens
            if piece.cached_tokens is not None:
                rec.cached_tokens = piece.cached_tokens
            if piece.completion_tokens is not None:
                rec.output_tokens = piece.completion_tokens
            if turn.cancel_after is not None and rec.chunks >= turn.cancel_after:
                rec.cancelled = True
                break
        rec.ok = True
    except asyncio.CancelledError:
        raise
    except Exception as exc:                # noqa: BLE001 -- recorded, the run goes on
        rec.error = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        with contextlib.suppress(Exception):
            await agen.aclose()
    rec.latency = time.perf_counter() - t0
    if not rec.output_tokens:               # no usage reported (cancelled): what was streamed
        rec.output_tokens = counted
    return rec, "".join(text)


async def run_job(backend: Backend, job: Job, t_origin: float, on_record) -> None:
    history: list[dict] = []
    for i, turn in enumerate(job.turns):
        rec, reply = await run_turn(backend, f"{job.job_id}-t{i}", job, i, turn,
                                    job.messages(history, turn), t_origin)
        on_record(rec)
        if not rec.ok or rec.cancelled:
            break
        history += [{"role": "user", "content": turn.user}, {"role": "assistant", "content": reply}]


def arrival_times(n: int, request_rate: float | None, seed: int) -> list[float]:
    """Start offsets (s): all zero without a rate or at ``inf``, else a seeded Poisson process."""
    if request_rate is None or math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0:
        raise ValueError(f"request_rate must be positive, got {request_rate}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out


async def run_jobs(backend: Backend, jobs: list[Job], *, concurrency: int | None = None,
                   request_rate: float | None = None, seed: int = 0,
                   progress: bool = True, desc: str = "") -> tuple[list[RequestRecord], float]:
    if concurrency is None and request_rate is None:
        raise ValueError("give concurrency, request_rate or both")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be positive, got {concurrency}")
    from tqdm import tqdm

    bar = tqdm(total=sum(len(j.turns) for j in jobs), desc=desc or "requests", unit="req",
               disable=not progress, leave=False)
    records: list[RequestRecord] = []

    def on_record(rec: RequestRecord) -> None:
        records.append(rec)
        bar.update(1)

    slots = asyncio.Semaphore(concurrency) if concurrency else None
    starts = arrival_times(len(jobs), request_rate, seed)
    t_origin = time.perf_counter()

    async def launch(job: Job, at: float) -> None:
        delay = at - (time.perf_counter() - t_origin)
        if delay > 0:
            await asyncio.sleep(delay)
        if slots is None:
            await run_job(backend, job, t_origin, on_record)
        else:
            async with slots:
                await run_job(backend, job, t_origin, on_record)

    try:
        await asyncio.gather(*(launch(j, at) for j, at in zip(jobs, starts)))
    finally:
        bar.close()
    duration = time.perf_counter() - t_origin
    records.sort(key=lambda r: r.start)
    return records, duration
