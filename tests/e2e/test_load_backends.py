"""The load harness's HTTP clients (load/backends.py) against the real shim: what they stream is
what the OpenAI SDK gets, and a stream they stop early is aborted in the engine (the cancel storm
and the cancel share of workloads depend on it)."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from load.backends import CompletionsBackend, ShimBackend, completion_body
from tests.e2e.shim_fixtures import KEY, async_sdk, shim  # noqa: F401
from tests.e2e.test_shim_abort import assert_aborted_and_freed, idle

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Count the apples in the basket."}]


async def _collect(backend, max_tokens: int):
    await backend.start()
    try:
        return [p async for p in backend.stream("load-backends", MESSAGES, max_tokens)]
    finally:
        await backend.close()


def test_shim_backend_streams_what_the_sdk_gets(shim, async_sdk):
    async def main():
        pieces = await _collect(ShimBackend(shim.url, api_key=KEY), 12)
        ref = await async_sdk.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12,
                                                      temperature=0, extra_body={"ignore_eos": True})
        return pieces, ref
    pieces, ref = asyncio.run(main())
    assert "".join(p.text for p in pieces) == ref.choices[0].message.content
    assert [p.finish_reason for p in pieces if p.finish_reason] == ["length"]
    assert [p.completion_tokens for p in pieces if p.completion_tokens is not None] == [12]   # usage chunk


def test_completions_backend_streams_what_the_sdk_gets(shim, async_sdk):
    async def main():
        pieces = await _collect(CompletionsBackend(shim.url, api_key=KEY), 10)
        body = completion_body("tiny", MESSAGES, 10)
        ref = await async_sdk.completions.create(model="tiny", prompt=body["prompt"], max_tokens=10,
                                                 temperature=0, extra_body={"ignore_eos": True})
        return pieces, ref
    pieces, ref = asyncio.run(main())
    assert "".join(p.text for p in pieces) == ref.choices[0].text
    assert [p.completion_tokens for p in pieces if p.completion_tokens is not None] == [10]


def test_a_stream_stopped_early_hangs_up_and_is_aborted(shim):
    before = idle(shim.metrics_url)

    async def main():
        backend = ShimBackend(shim.url, api_key=KEY)
        await backend.start()
        try:
            got = 0
            async with contextlib.aclosing(backend.stream("load-cancel", MESSAGES, 900)) as stream:
                async for piece in stream:
                    got += piece.has_content
                    if got >= 3:
                        break                   # the runner's cancel: close the stream
            # aborted while the client session (its connection pool) is still open: the stream's
            # own close hung up; a 900-token run to the end is never counted
            await asyncio.to_thread(assert_aborted_and_freed, shim.metrics_url, before)
            return got
        finally:
            await backend.close()
    assert asyncio.run(main()) == 3
