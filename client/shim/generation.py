"""One HTTP request's generation: gRPC streams, merged choices, and the client-disconnect watch.

A completions request may carry several prompts; each is its own gRPC stream and its choices are
numbered ``prompt_index * n + index``. Every cleanup path here is synchronous (it only cancels
tasks / closes generators whose own cleanup does not await), so it works inside a task that the
server already cancelled because the HTTP client went away.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from fastapi import Request

from client.wire import Chunk

Item = tuple[int, int, Chunk]                    # (choice index, prompt index, chunk)
QUEUE_ITEMS = 64                                 # chunks merged from several prompts, waiting


class ClientDisconnected(Exception):
    """The HTTP client closed the connection; the generation was cancelled and aborted."""


async def _single(agen: AsyncIterator[Chunk]) -> AsyncIterator[Item]:
    try:
        async for chunk in agen:
            yield chunk.index, 0, chunk
    finally:
        await agen.aclose()                      # already finished when we got here by an exception


async def merged(agens: list[AsyncIterator[Chunk]], n: int) -> AsyncIterator[Item]:
    """Interleave several prompts' streams as they produce; the first error stops them all."""
    if len(agens) == 1:
        async for item in _single(agens[0]):
            yield item
        return
    # Bounded: a consumer that stops pulling (a slow SSE client) stops the pumps too, so what
    # waits here is at most QUEUE_ITEMS chunks, and the rest stays in the gRPC streams.
    queue: asyncio.Queue = asyncio.Queue(maxsize=QUEUE_ITEMS)
    _END = object()

    async def pump(pi: int, agen: AsyncIterator[Chunk]) -> None:
        try:
            async for chunk in agen:
                await queue.put((pi * n + chunk.index, pi, chunk))
            await queue.put(_END)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:             # noqa: BLE001 -- re-raised by the consumer
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(pi, g)) for pi, g in enumerate(agens)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()                           # each stream's own cleanup cancels + aborts


async def until_disconnect(request: Request | None, awaitable, poll_s: float = 0.1):
    """Await ``awaitable``; if the HTTP client disconnects first, cancel it and raise
    ClientDisconnected (uvicorn does not cancel a plain handler when its client leaves)."""
    task = asyncio.ensure_future(awaitable)
    if request is None:
        return await task
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                raise ClientDisconnected()
    except asyncio.CancelledError:
        # the handler itself was cancelled (Ray Serve does so when a client hangs up): let the
        # inner task finish its cleanup before the caller's ``finally`` closes what it iterates
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise


async def collect(items: AsyncIterator[Item], tally) -> None:
    async for index, prompt_index, chunk in items:
        tally.add(index, prompt_index, chunk)
