"""The front of prefill/decode disaggregation: one client object over two tritonservers, with
TritonLLMClient's interface, so the OpenAI shim uses it unchanged (``--triton-grpc-decode``).

    client = DisaggLLMClient("127.0.0.1:8001", "127.0.0.1:8011")   # prefill server, decode server
    async for chunk in client.generate(prompt="Hello", params={"max_tokens": 32}):
        ...

A request goes to the prefill server. Its stream either finishes there (n > 1, structured
outputs, a first token that ends it: the chunks pass through) or ends with one response whose
finish_reason is ``handover`` and whose ``metrics`` carry the Handover record (backend/protocol.py
HANDOVER). Then the continuation -- the same request, same id, plus parameter ``handover`` = the
record -- goes to the decode server, which fetches the prompt's KV from the prefill host and
streams from the first token. The caller sees one stream; its TTFT includes the hand-over.

Aborts reach whichever server holds the request: while the prefill stream is open the prefill
client aborts it; from the record on, stopping early aborts on the decode server (the inner
client does, pending record or running request) *and* on the prefill server, which releases the
KV it still stages for that id (a no-op once the decode side fetched it). ``abort(id)`` asks both.
"""
from __future__ import annotations

import asyncio
import uuid
from typing import Any, AsyncIterator, Callable

from backend import protocol as P
from client.errors import InternalError
from client.triton_client import TritonLLMClient
from client.wire import Chunk

__all__ = ["DisaggLLMClient"]


class DisaggLLMClient:
    def __init__(self, prefill: str | Any, decode: str | Any, **kw: Any) -> None:
        """Each side a gRPC URL (a TritonLLMClient is made with ``kw``) or a client object with
        TritonLLMClient's interface (Ray Serve: triton_llm/scale/serve_client.py ServeClient)."""
        self.prefill = TritonLLMClient(prefill, **kw) if isinstance(prefill, str) else prefill
        self.decode = TritonLLMClient(decode, **kw) if isinstance(decode, str) else decode
        self.url = prefill if isinstance(prefill, str) else getattr(prefill, "url", "")
        self.handovers = 0          # streams continued on the decode server
        self.kept = 0               # streams the prefill server finished itself
        self._aborts: set[asyncio.Task] = set()

    def __getattr__(self, name: str) -> Any:
        """Anything else (model metadata, weights info...) is the prefill server's answer."""
        if name in ("prefill", "decode"):
            raise AttributeError(name)
        return getattr(self.prefill, name)

    async def close(self) -> None:
        await self.wait_aborts()
        await asyncio.gather(self.prefill.close(), self.decode.close())

    async def __aenter__(self) -> "DisaggLLMClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def is_ready(self, timeout: float = 2.0) -> bool:
        a, b = await asyncio.gather(self.prefill.is_ready(timeout), self.decode.is_ready(timeout))
        return a and b

    async def context_window(self, timeout: float = 5.0) -> int:
        a, b = await asyncio.gather(self.prefill.context_window(timeout), self.decode.context_window(timeout))
        return min(a, b)

    # -- generation -----------------------------------------------------------------------------
    def generate(self, prompt: str | None = None, messages: list[dict] | None = None, *,
                 request_id: str | None = None, params: dict | None = None,
                 stream: bool = True) -> AsyncIterator[Chunk]:
        rid = request_id or uuid.uuid4().hex
        return self._route(lambda c, p: c.generate(prompt, messages, request_id=rid, params=p, stream=stream),
                           rid, params)

    def generate_ids(self, input_ids: list[int], *, request_id: str | None = None,
                     params: dict | None = None, stream: bool = True) -> AsyncIterator[Chunk]:
        rid = request_id or uuid.uuid4().hex
        return self._route(lambda c, p: c.generate_ids(input_ids, request_id=rid, params=p, stream=stream),
                           rid, params)

    async def _route(self, call: Callable[[TritonLLMClient, dict | None], AsyncIterator[Chunk]],
                     rid: str, params: dict | None) -> AsyncIterator[Chunk]:
        if params and P.HANDOVER in params:
            raise ValueError(f"request parameter {P.HANDOVER!r} is set by the router only")
        record = None
        done = False
        try:
            first = call(self.prefill, params)
            try:
                async for chunk in first:
                    if chunk.finish_reason == P.FINISH_HANDOVER:
                        record = (chunk.metrics or {}).get(P.HANDOVER)
                        if not record:
                            raise InternalError(f"request {rid}: the prefill server handed over without a record")
                        continue
                    yield chunk
            finally:
                await first.aclose()
            if record is None:
                self.kept += 1
                done = True
                return
            self.handovers += 1
            second = call(self.decode, {**(params or {}), P.HANDOVER: record})
            try:
                async for chunk in second:      # its own early exit aborts on the decode server
                    yield chunk
            finally:
                await second.aclose()
            done = True
        finally:
            if record is not None and not done:
                # in transfer or decoding: the prefill server drops what it still stages for rid
                self._spawn(self.prefill.abort(rid, tenant=(params or {}).get(P.TENANT)))

    # -- aborts ---------------------------------------------------------------------------------
    def _spawn(self, coro) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:                    # no loop (interpreter shutdown)
            coro.close()
            return
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def abort(self, request_id: str, timeout: float = 10.0, *, tenant: str | None = None) -> bool:
        """Stop ``request_id`` wherever it is (both servers; releases staged KV); True if both answered."""
        a, b = await asyncio.gather(self.prefill.abort(request_id, timeout, tenant=tenant),
                                    self.decode.abort(request_id, timeout, tenant=tenant))
        return a and b

    async def wait_aborts(self, timeout: float = 10.0) -> None:
        if self._aborts:
            await asyncio.wait(list(self._aborts), timeout=timeout)
        await asyncio.gather(self.prefill.wait_aborts(timeout), self.decode.wait_aborts(timeout))
