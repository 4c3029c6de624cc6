"""Bounds on what one request may make the shim do, checked before the work they bound (the
response's writes: while it streams).

    BodyLimit (ASGI middleware)   the request body: Content-Length checked before reading, the bytes
                                  counted while reading; 413 before JSON parsing or routing (a
                                  keyless caller had its 401 before: auth.py KeyFirst);
                                  408 when it trickles in for longer than the body timeout;
                                  a lone surrogate escape (not encodable text) is a 400 there too
    schemas.py (pydantic Fields)  n, the prompt list, integers (int64 and each one's range), stop
                                  strings: a 400 before any choice array or gRPC stream exists
    check_prompt_chars            prompt characters against a multiple of the context window,
                                  before the server tokenizes anything
    BoundedSSE (the response)     a stream's writes: a client that takes no bytes for the write
                                  timeout is cut off and its request aborted, not buffered

A bad request costs the shim at most one body of ``max_body_bytes`` and a pydantic pass; a client
that stops reading, one stream's transport buffer and ``write_timeout`` seconds.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re

import anyio
from starlette.responses import StreamingResponse

from client.shim.errors import OpenAIError, invalid
from common.param_codec import INT64_MAX, INT64_MIN  # noqa: F401 - schemas.py's bounds: the wire's

log = logging.getLogger("triton_llm.shim")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0   # the whole body must arrive within this (408 otherwise)
# The longest prompt (all chat message text together) in characters, as a multiple of the context
# window in tokens. A token is rarely longer than a few characters, so a prompt longer than this
# cannot fit anyway; the cap bounds the tokenizer's work on one request.
DEFAULT_PROMPT_CHARS_PER_TOKEN = 16

MAX_N = 16                      # the engine's own limit (SamplingParams)
MAX_PROMPTS = 32                # completions: prompts in one request (one gRPC stream each)
MAX_STOP = 4                    # stop strings (OpenAI's limit)
MAX_STOP_CHARS = 256            # characters of one stop string (the stop checker scans each one)
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
INT32_MAX = 2 ** 31 - 1
PRIORITY_MIN, PRIORITY_MAX = -(2 ** 31), INT32_MAX


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"The request body is larger than {limit} bytes.", "invalid_request_error",
                       None, "request_too_large", {"Connection": "close"})


class BodyLimit:
    """ASGI middleware: read the whole body (at most ``max_bytes``) before the app sees the request.

    A declared Content-Length over the limit is refused before a byte is read; a chunked body is
    counted as it arrives and refused as soon as it passes the limit. The app then receives the
    buffered body in one message, and later ``receive()`` calls go to the server (disconnects)."""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 timeout: float = DEFAULT_BODY_TIMEOUT_S) -> None:
        self.app, self.max_bytes, self.timeout = app, int(max_bytes), float(timeout)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await send_error(send, too_large(self.max_bytes), scope.get("path", ""))
            return
        chunks: list[bytes] = []
        try:            # asyncio's timer, not anyio's cancel scope: a fraction of its cost per request
            async with asyncio.timeout(self.timeout):           # a body trickled in forever
                outcome = await self._read(receive, chunks)
        except TimeoutError:
            outcome = "slow"
        if outcome == "gone":
            return                                  # the client left before sending its body
        if outcome in ("large", "slow"):
            err = too_large(self.max_bytes) if outcome == "large" else OpenAIError(
                408, f"The request body did not arrive within {self.timeout:g} s.",
                "invalid_request_error", None, "request_timeout", {"Connection": "close"})
            await send_error(send, err, scope.get("path", ""))
            return
        if has_lone_surrogate(b"".join(chunks)):
            await send_error(send, invalid("The request body has a lone UTF-16 surrogate escape "
                                            "(\\uD800-\\uDFFF without its pair): not valid Unicode."),
                             scope.get("path", ""))
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive, chunks: list[bytes]) -> str:
        """Receive the body into ``chunks``: "ok", "large" (past max_bytes) or "gone"."""
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return "gone"
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                return "large"
            chunks.append(body)
            if not message.get("more_body", False):
                return "ok"


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def has_lone_surrogate(body: bytes) -> bool:
    """A JSON body whose strings hold an unpaired surrogate (``"\\ud800"``): valid JSON, but not
    text that UTF-8 (gRPC, SQLite, the tokenizer) can carry. Parsed only when an escape is there."""
    if not _SURROGATE_ESCAPE.search(body):
        return False
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return False                                # not JSON (or too deep): the app answers that
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def send_error(send, err: OpenAIError, path: str) -> None:
    """A middleware's error answer, in the shape of the API ``path`` belongs to (errors.py)."""
    body = json.dumps(err.body(path)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def check_prompt_chars(chars: int, context_window: int, chars_per_token: int, param: str) -> None:
    """400 when a prompt of ``chars`` characters cannot fit ``context_window`` tokens."""
    limit = context_window * chars_per_token
    if chars > limit:
        raise invalid(f"The prompt has {chars} characters; at most {limit} are accepted "
                      f"({chars_per_token} per token of the {context_window}-token context window).",
                      param, "context_length_exceeded")


class BoundedSSE(StreamingResponse):
    """The SSE response with backpressure: a client that stops reading is cut off, not buffered.

    Events are made only as fast as the socket takes them: the generator is pulled one event per
    ``send``, and uvicorn's ``send`` waits while its transport holds more than 64 KiB (its flow
    control). So what one stream can hold in the shim is that buffer plus one event; what the engine
    produces meanwhile waits in the gRPC stream. A client that takes no bytes for ``write_timeout``
    seconds would hold the request's KV blocks for nothing, so its stream is closed: the body
    generator is closed (its cleanup sends the explicit abort, which frees the blocks, and drains
    the half-closed gRPC stream), and returning without finishing the response makes uvicorn close the
    connection."""

    def __init__(self, content, *, write_timeout: float, name: str = "", on_close=None, **kwargs) -> None:
        super().__init__(content, media_type="text/event-stream", **kwargs)
        self.write_timeout, self.name, self.on_close = write_timeout, name, on_close
        self.cut_off = False

    async def __call__(self, scope, receive, send) -> None:
        """Stream the body while one plain asyncio task watches for the client's disconnect, which
        cancels the stream (its ``finally`` below closes the body generator: explicit abort + drain).
        Starlette's own ``__call__`` runs an anyio task group per response for the same watch (a
        spawned task, cancel scopes, a task repr on every cancel: ~0.2 ms of the shim's CPU per
        request)."""
        task = asyncio.current_task()
        state = {"streaming": True, "gone": False}

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    if state["streaming"]:
                        state["gone"] = True
                        task.cancel()
                    return

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            # the client left: the response ends here, as Starlette's task group ends it; a
            # cancellation from anywhere else (server shutdown) goes on
            if not state["gone"] or task.uncancel() > 0:
                raise
        finally:
            state["streaming"] = False
            watcher.cancel()
        if self.background is not None:
            await self.background()

    async def stream_response(self, send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                body = chunk.encode(self.charset) if isinstance(chunk, str) else chunk
                # asyncio.timeout, not anyio.move_on_after: one timer handle per chunk instead of
                # anyio's backend lookup + cancel scope (~10 % of the shim's CPU at 1 stream).
                try:
                    async with asyncio.timeout(self.write_timeout):
                        await send({"type": "http.response.body", "body": body, "more_body": True})
                except TimeoutError:
                    self.cut_off = True
                    log.warning("%s: the client took no data for %.1f s; stream aborted",
                                self.name, self.write_timeout)
                    return              # uvicorn closes a connection whose response did not finish
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            # Runs on every exit, the client's disconnect (a cancellation) included.
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
            if self.on_close is not None:
                self.on_close()
