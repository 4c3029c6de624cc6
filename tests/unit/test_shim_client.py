"""TritonLLMClient without a server: error tags, parameters, end of stream, cancel + explicit abort."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from client.errors import (InternalError, InvalidRequestError, QueueFullError, UnavailableError,
                           error_from_message)
from client.triton_client import TritonLLMClient
from client.wire import Chunk, parse_response, to_parameters


# -- error tags ------------------------------------------------------------------------------------
def test_error_tags_map_to_types():
    e = error_from_message("in ensemble 'llm', [invalid_request param=messages] the prompt has 9 tokens")
    assert isinstance(e, InvalidRequestError) and e.param == "messages" and e.status == 400
    assert e.message == "the prompt has 9 tokens"
    q = error_from_message("[queue_full retry_after=3] 256 requests are waiting")
    assert isinstance(q, QueueFullError) and q.retry_after == 3 and q.status == 429
    assert isinstance(error_from_message("[unavailable] draining"), UnavailableError)
    assert isinstance(error_from_message("[internal] boom"), InternalError)
    assert isinstance(error_from_message("Request for unknown model: 'llm' is not found"), UnavailableError)
    assert isinstance(error_from_message("something odd"), InternalError)


def test_parameters_are_triton_scalars():
    p = to_parameters({"stop": ["a", "b"], "stop_token_ids": [1], "n": np.int64(2), "top_p": 0.5,
                       "stream": True, "seed": None})
    assert p == {"stop": '["a", "b"]', "stop_token_ids": "[1]", "n": 2, "top_p": 0.5, "stream": True}
    assert to_parameters({"priority": 1, "timeout": 2.5}) == {"request_priority": 1, "request_timeout": 2.5}
    with pytest.raises(ValueError, match="reserved"):
        to_parameters({"sequence_id": 1})
    with pytest.raises(ValueError, match="reserved"):
        to_parameters({"triton_enable_empty_final_response": True})


class FakeResult:
    def __init__(self, **outputs):
        self.outputs = {}
        for k, v in outputs.items():
            if isinstance(v, str):
                v = np.array([v.encode()], dtype=object)
            elif isinstance(v, list):
                v = np.array(v, dtype=np.int32)
            else:
                v = np.array([v], dtype=np.int32)
            self.outputs[k] = v

    def as_numpy(self, name):
        return self.outputs.get(name)


def result(index=0, text="", finish="", ids=(), **kw):
    return FakeResult(text_output=text, finish_reason=finish, index=index, output_ids=list(ids),
                      prompt_tokens=kw.get("prompt_tokens", 3), completion_tokens=kw.get("completion_tokens", 1),
                      cached_tokens=0, logprobs=kw.get("logprobs", ""), metrics=kw.get("metrics", ""))


def test_parse_response():
    c = parse_response(result(1, "héllo", "stop", [5, 6], metrics='{"ttft": 0.1}',
                              logprobs='[{"token": "h", "logprob": -1.0}]'))
    assert c == Chunk(index=1, text="héllo", token_ids=[5, 6], finish_reason="stop", prompt_tokens=3,
                      completion_tokens=1, cached_tokens=0, logprobs=[{"token": "h", "logprob": -1.0}],
                      metrics={"ttft": 0.1})


# -- streams ---------------------------------------------------------------------------------------
class FakeError:
    def __init__(self, msg):
        self.msg = msg

    def message(self):
        return self.msg


class FakeCall:
    """What tritonclient.grpc.aio's stream_infer returns: an async iterator with cancel()."""

    def __init__(self, requests, script, hang):
        self.requests, self.script, self.hang = requests, list(script), hang
        self.cancelled = False
        self.first = None

    async def __anext__(self):
        if self.first is None:
            self.first = await self.requests.__anext__()
        if self.script:
            await asyncio.sleep(0)
            return self.script.pop(0)
        if self.hang:
            await asyncio.Event().wait()
        raise StopAsyncIteration

    def __aiter__(self):
        return self

    def cancel(self):
        self.cancelled = True


class FakeGrpc:
    def __init__(self, script=(), hang=True):
        self.script, self.hang = script, hang
        self.calls: list[FakeCall] = []

    def stream_infer(self, requests):
        call = FakeCall(requests, self.script if not self.calls else [], hang=self.hang and not self.calls)
        self.calls.append(call)
        return call

    async def close(self):
        pass


def make_client(script, hang=True):
    c = TritonLLMClient("fake:1")
    c._grpc = FakeGrpc(script, hang)
    return c


def aborts(client):
    return [call.first["parameters"]["abort_request_id"] for call in client._grpc.calls[1:]]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))       # a hang guard; generous for a loaded CI host


def test_stream_ends_when_every_choice_finished_without_waiting_for_final():
    script = [(result(0, "a"), None), (result(1, "b"), None), (result(0, "c", "stop"), None),
              (result(1, "d", "length"), None)]         # then the fake hangs: no FINAL ever comes

    async def go():
        client = make_client(script)
        chunks = [c async for c in client.generate(prompt="hi", request_id="r1", params={"n": 2})]
        await client.wait_aborts()
        return client, chunks

    client, chunks = run(go())
    assert [(c.index, c.text, c.finish_reason) for c in chunks] == [
        (0, "a", None), (1, "b", None), (0, "c", "stop"), (1, "d", "length")]
    first = client._grpc.calls[0].first
    assert first["model_name"] == "llm" and first["request_id"] == "r1"
    assert first["parameters"] == {"n": 2, "stream": True}
    assert aborts(client) == []                              # finished: nothing to abort


async def _leave_after_first_chunk(client, **kw):
    """Read one chunk of a generation, leave the stream, wait for the spawned abort(s)."""
    agen = client.generate(**kw)
    async for _ in agen:
        break
    await agen.aclose()
    await client.wait_aborts()
    return client


def test_early_exit_cancels_stream_and_sends_explicit_abort():
    client = run(_leave_after_first_chunk(make_client([(result(0, "a"), None), (result(0, "b"), None)]),
                                          messages=[{"role": "user", "content": "x"}], request_id="r2", params={}))
    assert client._grpc.calls[0].cancelled
    assert aborts(client) == ["r2"]
    abort_req = client._grpc.calls[1].first
    assert abort_req["model_name"] == "engine" and abort_req["inputs"] == []


def test_a_failed_abort_is_sent_once_more(monkeypatch):
    """The abort is what stops a stream we left; one that failed (timed out on a busy server) is
    retried, so the request does not run to its end."""
    import client.triton_client as tc

    monkeypatch.setattr(tc, "ABORT_RETRY_DELAY", 0.0)

    class FailingAbortCall(FakeCall):
        async def __anext__(self):
            await self.requests.__anext__()
            raise ConnectionError("the server dropped the connection")

    async def go():
        client = make_client([(result(0, "a"), None), (result(0, "b"), None)])
        grpc, made = client._grpc, []
        real = grpc.stream_infer

        def stream_infer(requests):
            if len(grpc.calls) == 1 and not made:        # the first abort fails
                made.append(1)
                call = FailingAbortCall(requests, [], hang=False)
                grpc.calls.append(call)
                return call
            return real(requests)

        grpc.stream_infer = stream_infer
        return await _leave_after_first_chunk(client, prompt="p", request_id="r-retry", params={})

    client = run(go())
    assert len(client._grpc.calls) == 3                      # the stream, a failed abort, the retry
    assert client._grpc.calls[2].first["parameters"]["abort_request_id"] == "r-retry"


def test_explicit_abort_carries_the_streams_tenant():
    """The engine aborts only a request of the caller's own tenant, so the abort must say which."""
    client = run(_leave_after_first_chunk(make_client([(result(0, "a"), None), (result(0, "b"), None)]),
                                          prompt="p", request_id="r-t", params={"tenant": "acme"}))
    assert aborts(client) == ["r-t"]
    assert client._grpc.calls[1].first["parameters"] == {"abort_request_id": "r-t", "tenant": "acme"}


def test_cancelled_consumer_task_aborts():
    async def go():
        client = make_client([(result(0, "a"), None)])       # then hangs mid-generation
        got = asyncio.Event()

        async def consume():
            async for _ in client.generate(prompt="p", request_id="r3", params={}):
                got.set()

        task = asyncio.create_task(consume())
        await got.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await client.wait_aborts()
        return client

    client = run(go())
    assert client._grpc.calls[0].cancelled and aborts(client) == ["r3"]


@pytest.mark.parametrize("msg, exc, aborted", [
    ("[queue_full retry_after=2] full", QueueFullError, False),
    ("[invalid_request param=top_p] top_p must be in (0, 1]", InvalidRequestError, False),
    ("[internal] postprocessing failed", InternalError, True),   # the engine may still run
])
def test_error_response_ends_stream(msg, exc, aborted):
    async def go():
        client = make_client([(result(0, "a"), None), (None, FakeError(msg))])
        with pytest.raises(exc):
            async for _ in client.generate(prompt="p", request_id="r4", params={}):
                pass
        await client.wait_aborts()
        return client

    client = run(go())
    assert aborts(client) == (["r4"] if aborted else [])


def test_stream_closed_early_is_unavailable_not_success():
    async def go():
        client = make_client([(result(0, "a"), None)], hang=False)
        with pytest.raises(UnavailableError):
            async for _ in client.generate(prompt="p", request_id="r5", params={}):
                pass

    run(go())


def test_engine_model_takes_token_ids():
    script = [(FakeResult(output_ids=[7, 8], window_ids=[1, 7, 8], num_sent=1, max_chars=-1,
                          finish_reason="length", index=0, prompt_tokens=3, completion_tokens=2,
                          cached_tokens=0, logprobs=json.dumps([{"id": 7, "logprob": -0.1, "top": []}]),
                          metrics=""), None)]

    async def go():
        client = make_client(script)
        return client, [c async for c in client.generate_ids([1, 2, 3], params={"max_tokens": 2})]

    client, chunks = run(go())
    assert client._grpc.calls[0].first["model_name"] == "engine"
    assert chunks[0].token_ids == [7, 8] and chunks[0].window_ids == [1, 7, 8] and chunks[0].num_sent == 1
    assert chunks[0].logprobs == [{"id": 7, "logprob": -0.1, "top": []}]


def test_sync_wrapper_break_aborts_and_waits():
    from client.sync_client import SyncTritonLLMClient

    with SyncTritonLLMClient("fake:1") as sync:
        sync.client._grpc = FakeGrpc([(result(0, "a"), None), (result(0, "b"), None)])
        for chunk in sync.generate(prompt="p", request_id="s1", params={}):
            assert chunk.text == "a"
            break
        # generate's cleanup already waited for the abort to be answered
        assert aborts(sync.client) == ["s1"]
        sync.client._grpc = FakeGrpc([(result(0, "x", "stop"), None)])
        assert [c.text for c in sync.generate(prompt="p", request_id="s2")] == ["x"]
        assert aborts(sync.client) == []
