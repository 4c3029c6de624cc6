"""Where benchmark requests go: the OpenAI shim (HTTP+SSE), the Triton ensemble (gRPC stream), or
the engine in this process (EngineLoop). Each backend streams :class:`Piece` s; the runner stops a
request early (a cancel) by closing the stream, and each backend's cleanup does what a real client
does: the HTTP connection closes, the gRPC client sends the explicit abort, the in-process backend
calls ``abort``.

Greedy decoding with ``ignore_eos`` so output lengths are the workload's, whatever the weights.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
import time
from dataclasses import dataclass
from typing import AsyncIterator

from load.counters import scrape_counters


@dataclass
class Piece:
    """One streamed response. ``tokens`` counts the delta's tokens where the backend knows them
    (gRPC, in-process); over HTTP each chunk with text counts as one."""
    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    at: float | None = None         # perf_counter() when it was produced, if not when received

    @property
    def has_content(self) -> bool:
        return bool(self.text) or self.tokens > 0


class Backend:
    name = "backend"

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def stream(self, request_id: str, messages: list[dict], max_tokens: int) -> AsyncIterator[Piece]:
        raise NotImplementedError

    async def counters(self) -> dict[str, float]:
        """A snapshot of the engine's work counters (see load/counters.py); {} if unknown."""
        return {}

    async def kv_usage(self) -> float | None:
        return (await self.counters()).get("kv_usage")


class ShimBackend(Backend):
    """POST /v1/chat/completions with stream=true, read as raw SSE lines."""
    name = "http"

    def __init__(self, base_url: str, *, api_key: str | None = None, metrics_url: str | None = None,
                 timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"
        self.api_key = api_key
        self.metrics_url = metrics_url
        self.timeout = timeout
        self.model = None
        self._http = None

    async def start(self) -> None:
        # aiohttp, not httpx: the client shares the two cores with the stack it measures, and
        # httpx's streaming (httpcore over anyio) spent several times aiohttp's CPU per SSE line.
        import aiohttp

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        # A connection per request (force_close): a reused idle connection that the server closes
        # that instant loses the request as "Server disconnected" (uvicorn closes idle ones at 5 s:
        # once in 96 bench-110m requests with --keep-up; llama-server: 6 of 32 SmolLM2 requests
        # at 16 streams in one peers run). A connect costs far less than one streamed request.
        self._http = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=self.timeout),
                                           connector=aiohttp.TCPConnector(limit=1024, force_close=True))
        async with self._http.get(f"{self.base_url}/models") as r:
            r.raise_for_status()
            self.model = (await r.json())["data"][0]["id"]

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    async def sse_lines(self, path: str, body: dict) -> AsyncIterator[str]:
        """POST ``body`` to ``path`` and yield the response's lines (without line ends); close it with
        ``contextlib.aclosing`` so that a stream stopped early hangs up at once (a cancel)."""
        async with self._http.post(f"{self.base_url}{path}", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:300]!r}")
            async for raw in resp.content:
                yield raw.decode().rstrip("\r\n")

    async def stream(self, request_id, messages, max_tokens):
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0, "ignore_eos": True,
                "user": request_id}
        async with contextlib.aclosing(self.sse_lines("/chat/completions", body)) as lines:
            async for line in lines:
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                yield piece_of_event(json.loads(data), lambda c: (c.get("delta") or {}).get("content"))

    async def counters(self):
        return await asyncio.to_thread(scrape_counters, self.metrics_url) if self.metrics_url else {}


class CompletionsBackend(ShimBackend):
    """POST /v1/completions with stream=true: the peer comparison's common ground, spoken the same
    way by our shim and llama.cpp's ``llama-server``. The conversation's messages are joined into
    one plain prompt (no chat template, which the two servers would render differently)."""
    name = "completions"

    def __init__(self, base_url: str, *, label: str = "completions", **kw) -> None:
        super().__init__(base_url, **kw)
        self.name = label

    async def stream(self, request_id, messages, max_tokens):
        body = completion_body(self.model, messages, max_tokens)
        async with contextlib.aclosing(self.sse_lines("/completions", body)) as lines:
            async for line in lines:
                piece = parse_completion_line(line)
                if piece is None:
                    continue
                if piece is DONE:
                    return
                yield piece


DONE = Piece(finish_reason="[DONE]")


def completion_body(model: str, messages: list[dict], max_tokens: int) -> dict:
    """Greedy, ``ignore_eos``, streamed with a final usage chunk."""
    prompt = "\n".join(m["content"] for m in messages)
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0, "ignore_eos": True}


def parse_completion_line(line: str) -> Piece | None:
    """One SSE line of /v1/completions: a Piece, ``DONE``, or None (not a data line)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return DONE
    return piece_of_event(json.loads(data), lambda c: c.get("text"))


def piece_of_event(event: dict, text_of) -> Piece:
    """One OpenAI SSE chunk (chat or completions, ``text_of`` picks the choice's text) -> Piece."""
    if "error" in event:
        raise RuntimeError(f"stream error: {event['error']}")
    piece = Piece()
    for choice in event.get("choices") or []:
        piece.text += text_of(choice) or ""
        piece.finish_reason = choice.get("finish_reason") or piece.finish_reason
    usage = event.get("usage")
    if usage:
        piece.prompt_tokens = usage.get("prompt_tokens")
        piece.completion_tokens = usage.get("completion_tokens")
        piece.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return piece


class GrpcBackend(Backend):
    """The ``llm`` ensemble over a gRPC stream (client/triton_client.py: one stream per request,
    explicit abort on an early stop)."""
    name = "grpc"

    def __init__(self, url: str, *, metrics_url: str | None = None) -> None:
        self.url = url
        self.metrics_url = metrics_url
        self._client = None

    async def start(self) -> None:
        from client.triton_client import TritonLLMClient

        self._client = TritonLLMClient(self.url)
        if not await self._client.is_ready(timeout=10):
            raise RuntimeError(f"Triton at {self.url} is not ready")

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def stream(self, request_id, messages, max_tokens):
        params = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        agen = self._client.generate(messages=messages, request_id=request_id, params=params)
        try:
            async for c in agen:
                yield Piece(c.text, len(c.token_ids), c.finish_reason, c.prompt_tokens,
                            c.completion_tokens, c.cached_tokens)
        finally:
            await agen.aclose()

    async def counters(self):
        return await asyncio.to_thread(scrape_counters, self.metrics_url) if self.metrics_url else {}


class EngineBackend(Backend):
    """The engine in this process: ``EngineLoop`` on its own thread, deltas handed to asyncio.

    The baseline for the serving overhead, so it stays out of the engine's way: each delta is
    stamped in the engine thread as it leaves the step (that stamp is its arrival time) and
    buffered; one asyncio wake-up per step hands every buffered delta over, so the consumer does
    not contend for the GIL once per token. The chat template is applied here (preprocessing's
    job in the full stack); text is decoded once at the end, for multi-turn histories."""
    name = "engine"

    def __init__(self, model_dir: str | pathlib.Path, engine_options: dict | None = None) -> None:
        self.model_dir = pathlib.Path(model_dir)
        self.engine_options = dict(engine_options or {})
        self.loop = None
        self.tokenizer = None
        self._buffer: list = []            # (request id, stamp, delta), appended by the engine thread
        self._wake_pending = False
        self._queues: dict[str, asyncio.Queue] = {}
        self._aio = None

    def _sink(self, rid: str):
        def put(delta) -> None:             # engine thread
            self._buffer.append((rid, time.perf_counter(), delta))
            if not self._wake_pending:
                self._wake_pending = True
                self._aio.call_soon_threadsafe(self._drain)
        return put

    def _drain(self) -> None:               # event loop
        self._wake_pending = False
        items, self._buffer = self._buffer, []
        for rid, at, delta in items:
            q = self._queues.get(rid)
            if q is not None:
                q.put_nowait((at, delta))

    async def start(self) -> None:
        from transformers import AutoTokenizer

        from backend.config import EngineArgs
        from backend.engine import LLMEngine
        from backend.engine.engine_loop import EngineLoop

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        args = EngineArgs.from_dict({k: str(v) for k, v in self.engine_options.items()})
        engine = await asyncio.to_thread(LLMEngine, self.model_dir, args.engine, lora=args.lora)
        self.loop = EngineLoop(engine)
        self._aio = asyncio.get_running_loop()

    async def close(self) -> None:
        if self.loop is not None:
            await asyncio.to_thread(self.loop.shutdown, False)

    async def stream(self, request_id, messages, max_tokens):
        from backend.engine.admission import SamplingParams

        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        queue = self._queues[request_id] = asyncio.Queue()
        out_ids: list[int] = []
        done = False
        try:
            self.loop.submit(request_id, ids, params, sink=self._sink(request_id))
            while not done:
                at, d = await queue.get()
                if d.error:
                    raise RuntimeError(d.error)
                out_ids += d.new_token_ids
                done = d.finished
                text = self.tokenizer.decode(out_ids, skip_special_tokens=True) if done else ""
                yield Piece(text, len(d.new_token_ids), d.finish_reason if done else None,
                            d.prompt_tokens, d.completion_tokens, d.cached_tokens, at=at)
        finally:
            self._queues.pop(request_id, None)
            if not done:
                self.loop.abort(request_id)

    async def counters(self):
        from load.counters import engine_counters

        return engine_counters(self.loop.stats()) if self.loop is not None else {}
