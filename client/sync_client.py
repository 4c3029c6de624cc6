"""Blocking wrapper around TritonLLMClient: its own event loop on a daemon thread.

    with SyncTritonLLMClient("127.0.0.1:8001") as client:
        for chunk in client.generate(prompt="Hi", params={"max_tokens": 16}):
            print(chunk.text, end="", flush=True)

Leaving the ``for`` loop early (``break``, an exception, Ctrl-C) closes the generator, which cancels
the request's task on the loop thread -- the explicit abort, the stream half-closed and drained
(never an RPC cancel, client/triton_client.py) -- and waits until the abort was answered, so the
engine has freed the request when ``generate`` returns control.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from typing import Iterator

from client.triton_client import TritonLLMClient
from client.wire import Chunk

_DONE = object()


class SyncTritonLLMClient:
    def __init__(self, url: str = "127.0.0.1:8001", **kwargs) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="triton-llm-client",
                                        daemon=True)
        self._thread.start()
        self.client: TritonLLMClient = self._call(self._make(url, kwargs))

    @staticmethod
    async def _make(url: str, kwargs: dict) -> TritonLLMClient:
        return TritonLLMClient(url, **kwargs)

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def is_ready(self) -> bool:
        return self._call(self.client.is_ready())

    def context_window(self) -> int:
        return self._call(self.client.context_window())

    def abort(self, request_id: str, tenant: str | None = None) -> bool:
        return self._call(self.client.abort(request_id, tenant=tenant))

    def generate(self, prompt: str | None = None, messages: list[dict] | None = None,
                 **kwargs) -> Iterator[Chunk]:
        return self._iterate(lambda: self.client.generate(prompt, messages, **kwargs))

    def generate_ids(self, input_ids: list[int], **kwargs) -> Iterator[Chunk]:
        return self._iterate(lambda: self.client.generate_ids(input_ids, **kwargs))

    def _iterate(self, make_agen) -> Iterator[Chunk]:
        out: queue.Queue = queue.Queue()
        stopped = threading.Event()             # pump's cleanup (and any abort spawn) has run

        async def pump() -> None:
            try:
                async for chunk in make_agen():
                    out.put(chunk)
                out.put(_DONE)
            except asyncio.CancelledError:
                out.put(_DONE)
                raise
            except BaseException as exc:        # noqa: BLE001 -- handed to the consuming thread
                out.put(exc)
            finally:
                stopped.set()

        future = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while True:
                item = out.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not future.done():
                future.cancel()                 # cancels the task on the loop thread
            stopped.wait(timeout=5)
            self._call(self.client.wait_aborts())

    def close(self) -> None:
        if self._loop.is_running():
            self._call(self.client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    def __enter__(self) -> "SyncTritonLLMClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
