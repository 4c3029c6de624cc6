"""Asyncio gRPC streaming client for the ``llm`` ensemble (text) and the ``engine`` model (token ids).

    client = TritonLLMClient("127.0.0.1:8001")
    async for chunk in client.generate(prompt="Hello", params={"max_tokens": 32}):
        print(chunk.text, end="")

One gRPC stream per request. The stream is over when every choice (``n``) has a finish reason; an
error response ends it too (inside an ensemble no FINAL follows an error, so nothing waits for one).

Stopping early -- the consumer breaks, is cancelled, or the request failed after admission -- does
two things, neither of which awaits, so they also run inside an already-cancelled task:

    1. half-close the gRPC stream and drain it in the background (never cancel an RPC Triton may
       still write: Triton 2.51 leaks a stream cancelled mid-way, docs/serving.md), and
    2. spawn an explicit abort: a request to model ``engine`` with parameter
       ``abort_request_id=<id>`` and no inputs, which stops the request (a stream cancel would not
       reach a decoupled step inside an ensemble) and so ends its stream.
       ``await client.wait_aborts()`` waits for them.
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import AsyncIterator

import numpy as np

from backend import protocol as P
from client.errors import (AbortedError, InternalError, InvalidRequestError, QueueFullError,
                           TritonLLMError, UnavailableError, error_from_grpc, error_from_message)
from client.wire import Chunk, _input, parse_response, to_parameters

log = logging.getLogger("triton_llm.client")

ENSEMBLE = P.ENSEMBLE
ENGINE = P.ENGINE
ABORT_TIMEOUT = 10.0
ABORT_ATTEMPTS = 2             # a spawned abort that failed is sent once more
ABORT_RETRY_DELAY = 0.2

__all__ = ["Chunk", "TritonLLMClient", "TritonLLMError", "InvalidRequestError", "QueueFullError",
           "UnavailableError", "InternalError", "AbortedError", "to_parameters"]


class TritonLLMClient:
    """Streams generations from Triton over one shared gRPC channel (create it inside the loop
    that uses it; the channel itself is opened on first use)."""

    def __init__(self, url: str = "127.0.0.1:8001", *, ensemble: str = ENSEMBLE,
                 engine: str = ENGINE, preprocessing: str = P.PREPROCESSING, verbose: bool = False) -> None:
        self.url = url
        self.ensemble = ensemble
        self.engine = engine
        self.preprocessing = preprocessing
        self._verbose = verbose
        self._grpc = None
        self._aborts: set[asyncio.Task] = set()
        self._ending: set[asyncio.Task] = set()     # finished streams waiting for Triton's end

    def _client(self):
        if self._grpc is None:
            import tritonclient.grpc.aio as grpcclient

            self._grpc = grpcclient.InferenceServerClient(self.url, verbose=self._verbose)
        return self._grpc

    async def close(self) -> None:
        await self.wait_aborts()
        if self._ending:
            _, stuck = await asyncio.wait(list(self._ending), timeout=2.0)
            for task in stuck:
                task.cancel()
        if self._grpc is not None:
            grpc, self._grpc = self._grpc, None
            await grpc.close()

    async def __aenter__(self) -> "TritonLLMClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- health ---------------------------------------------------------------------------------
    async def is_ready(self, timeout: float = 2.0) -> bool:
        """Triton ready and the ensemble ready; False on any failure."""
        try:
            c = self._client()
            return bool(await c.is_server_ready(client_timeout=timeout)
                        and await c.is_model_ready(self.ensemble, client_timeout=timeout))
        except Exception:                       # noqa: BLE001 -- any failure means not ready
            return False

    async def context_window(self, timeout: float = 5.0) -> int:
        """The longest prompt + completion the server accepts: the engine's context_window()
        (backend/context.py), which the generated repository hands preprocessing as a parameter.
        Raises UnavailableError when the server cannot say."""
        try:
            cfg = await self._client().get_model_config(self.preprocessing, as_json=True,
                                                        client_timeout=timeout)
            value = cfg["config"]["parameters"][P.CONTEXT_WINDOW]["string_value"]
            return int(value)
        except Exception as exc:                 # noqa: BLE001 -- any failure: the server cannot say
            raise UnavailableError(f"the server did not report its context window: {exc}") from None

    async def weights_info(self, timeout: float = 5.0) -> dict:
        """What the engine's weights are: ``dtype``, ``quantization``, ``quant_group_size``,
        ``weight_bytes``, as the generated repository wrote them into the engine's config
        (backend/quant/plan.py reported_parameters). Raises UnavailableError when the server
        cannot say."""
        try:
            cfg = await self._client().get_model_config(self.engine, as_json=True, client_timeout=timeout)
            params = cfg["config"]["parameters"]
            raw = {k: params.get(k, {}).get("string_value", "") for k in P.WEIGHTS_PARAMS}   # "" is left out
            if not raw[P.WEIGHT_BYTES]:
                raise ValueError("the engine's weights parameters are empty (repository not generated)")
            group = raw[P.WEIGHTS_GROUP_SIZE]
            return {"dtype": raw[P.WEIGHTS_DTYPE], "quantization": raw[P.WEIGHTS_QUANTIZATION],
                    "quant_group_size": int(group) if group else None, "weight_bytes": int(raw[P.WEIGHT_BYTES])}
        except Exception as exc:                 # noqa: BLE001 -- any failure: the server cannot say
            raise UnavailableError(f"the server did not report its weights: {exc}") from None

    # -- generation -----------------------------------------------------------------------------
    def generate(self, prompt: str | None = None, messages: list[dict] | None = None, *,
                 request_id: str | None = None, params: dict | None = None,
                 stream: bool = True) -> AsyncIterator[Chunk]:
        """Text generation through the ensemble: exactly one of ``prompt`` / ``messages``."""
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt and messages")
        name, value = (P.TEXT_INPUT, prompt) if prompt is not None else (P.MESSAGES, json.dumps(messages))
        inp = _input(P.ENSEMBLE, name, np.array([value.encode("utf-8")], dtype=object))
        return self._stream(self.ensemble, [inp], request_id, params, stream)

    def generate_ids(self, input_ids: list[int], *, request_id: str | None = None,
                     params: dict | None = None, stream: bool = True) -> AsyncIterator[Chunk]:
        """Token ids in, token ids out: the ``engine`` model called directly."""
        inp = _input(P.ENGINE, P.INPUT_IDS, np.asarray(input_ids, dtype=np.int32))
        from tritonclient.grpc import InferRequestedOutput

        # the token outputs only: the engine then skips detokenizing (text_output, text_logprobs)
        outputs = [InferRequestedOutput(t.name) for t in P.ENGINE_TOKEN_OUTPUTS]
        return self._stream(self.engine, [inp], request_id, params, stream, outputs)

    async def embed(self, *, text: str | None = None, input_ids: list[int] | None = None,
                    params: dict | None = None, request_id: str | None = None) -> tuple[list[float], int]:
        """One embedding from the engine (parameter ``embed``): ``text`` is tokenized by the
        ``preprocessing`` model first. Returns (vector, prompt tokens); errors as ``generate``'s."""
        params = {**(params or {}), P.EMBED: True}
        if text is not None:
            inp = _input(P.PREPROCESSING, P.TEXT_INPUT, np.array([text.encode("utf-8")], dtype=object))
            try:
                result = await self._client().infer(self.preprocessing, [inp], parameters=to_parameters(params))
            except Exception as exc:            # tritonclient's InferenceServerException: a tagged message
                raise error_from_grpc(exc) from None
            input_ids = result.as_numpy(P.INPUT_IDS).reshape(-1).tolist()
        from tritonclient.grpc import InferRequestedOutput

        inp = _input(P.ENGINE, P.INPUT_IDS, np.asarray(input_ids, dtype=np.int32))
        outputs = [InferRequestedOutput(n) for n in (P.EMBEDDING, P.PROMPT_TOKENS, P.FINISH_REASON, P.INDEX)]
        vector, tokens = None, 0
        async for chunk in self._stream(self.engine, [inp], request_id, params, False, outputs):
            vector, tokens = chunk.embedding, chunk.prompt_tokens
        if vector is None:
            raise InternalError("the engine answered the embedding request without a vector")
        return vector, tokens

    async def _stream(self, model: str, inputs: list, request_id: str | None, params: dict | None,
                      stream: bool, outputs: list | None = None) -> AsyncIterator[Chunk]:
        rid = request_id or uuid.uuid4().hex
        parameters = to_parameters({**(params or {}), P.STREAM: bool(stream)})
        n = max(1, int(parameters.get(P.N, 1)))   # a bad n is the server's to reject
        closed = asyncio.Event()               # half-closes our side of the stream when set

        async def requests():
            req = {"model_name": model, "inputs": inputs, "request_id": rid, "parameters": parameters}
            if outputs:
                req["outputs"] = outputs
            yield req
            await closed.wait()

        finished: set[int] = set()
        admitted = True                         # False: rejected before the engine kept any state
        call = None
        read = None                             # the read in flight, shielded from our cancellation
        try:
            call = self._client().stream_infer(requests())
            while len(finished) < n:
                # A cancelled read cancels the RPC (grpc.aio does so for a read awaited in a task
                # that is cancelled: the shim's, when its HTTP client hangs up), which the finally
                # below must avoid; so the read runs in a task of its own that outlives ours.
                read = asyncio.ensure_future(call.__anext__())
                try:
                    result, error = await asyncio.shield(read)
                except StopAsyncIteration:
                    raise UnavailableError("Triton closed the stream before the request finished") from None
                except TritonLLMError:
                    raise
                except Exception as exc:        # grpc.aio.AioRpcError, connection loss
                    raise error_from_grpc(exc) from None
                if error is not None:
                    err = error_from_message(error.message() if hasattr(error, "message") else str(error))
                    admitted = not isinstance(err, (InvalidRequestError, QueueFullError))
                    raise err
                chunk = parse_response(result)
                if chunk.finish_reason == "abort":
                    finished.add(chunk.index)
                    raise AbortedError(f"the server aborted request {rid}")
                if chunk.finish_reason == "error":
                    raise InternalError(f"request {rid} failed in the engine")
                if chunk.finish_reason:
                    finished.add(chunk.index)
                yield chunk
        finally:
            closed.set()                        # half-close: Triton ends the RPC once FINAL is out
            if call is not None:
                # Never cancel the RPC while Triton may still be writing: Triton 2.51's gRPC front
                # end leaks the state (and request) of a stream cancelled mid-way or as its last
                # write completes -- ~120 KB of tritonserver RSS per cancelled request, and a
                # finished `llm` request that never unloads (issue 19, docs/serving.md). The
                # request is half-closed; an unfinished one is stopped by the explicit abort
                # below, which ends its stream; the RPC is drained in the background and only
                # cancelled if it does not end within ABORT_TIMEOUT.
                self._track(self._end_call(call, read if read is not None and not read.done() else None),
                            self._ending)
            if len(finished) < n and admitted:
                self._spawn_abort(rid, parameters.get(P.TENANT))

    @staticmethod
    async def _end_call(call, read: asyncio.Future | None = None, timeout: float = ABORT_TIMEOUT) -> None:
        """Drain ``call`` to its end (``read``: a read still in flight, left by a cancelled consumer)."""
        try:
            async def rest() -> None:
                if read is not None:
                    try:
                        await read
                    except StopAsyncIteration:
                        return
                async for _ in call:
                    pass
            await asyncio.wait_for(rest(), timeout)
        except BaseException:                   # noqa: BLE001 -- stuck or torn down: cancel after all
            call.cancel()

    @staticmethod
    def _track(coro, tasks: set) -> None:
        """Run a cleanup coroutine in the background without awaiting (``close`` waits)."""
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:                    # no loop (interpreter shutdown)
            coro.close()
            return
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def _spawn_abort(self, request_id: str, tenant: str | None = None) -> None:
        """Fire-and-forget explicit abort (safe inside a cancelled task: it does not await)."""
        try:
            task = asyncio.get_running_loop().create_task(self._abort_retrying(request_id, tenant))
        except RuntimeError:                    # no loop (interpreter shutdown)
            return
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort_retrying(self, request_id: str, tenant: str | None) -> bool:
        """The abort of a stream we left: it is the only thing that stops the request (the RPC is
        half-closed, never cancelled), so one that failed (a busy server timed out, the connection
        dropped) is sent once more rather than leaving the request to run to its end."""
        for attempt in range(ABORT_ATTEMPTS):
            if await self.abort(request_id, tenant=tenant):
                return True
            if attempt + 1 < ABORT_ATTEMPTS:
                await asyncio.sleep(ABORT_RETRY_DELAY)
        return False

    async def abort(self, request_id: str, timeout: float = ABORT_TIMEOUT, *,
                    tenant: str | None = None) -> bool:
        """Tell the engine to stop ``request_id`` and free its KV blocks; True once acknowledged.

        The engine only aborts a request of the caller's own tenant, so ``tenant`` must be the one
        the request was sent with (``_stream`` passes it)."""
        parameters = {P.ABORT_REQUEST_ID: request_id}
        if tenant is not None:
            parameters[P.TENANT] = tenant

        async def requests():
            yield {"model_name": self.engine, "inputs": [], "request_id": f"abort-{request_id}",
                   "parameters": parameters}
            # returning half-closes the stream; Triton ends it once the control request is FINAL

        call = None
        try:
            call = self._client().stream_infer(requests())

            async def drain() -> None:
                async for _result, error in call:
                    if error is not None:
                        log.warning("abort of %s answered with an error: %s", request_id, error)

            await asyncio.wait_for(drain(), timeout)
            return True
        except Exception as exc:                # noqa: BLE001 -- best effort, logged
            log.warning("abort of %s failed: %s: %s", request_id, type(exc).__name__, exc)
            return False
        finally:
            if call is not None:
                call.cancel()

    async def wait_aborts(self, timeout: float = ABORT_TIMEOUT) -> None:
        """Wait until every abort spawned so far has been sent and answered."""
        if self._aborts:
            await asyncio.wait(list(self._aborts), timeout=timeout)
