"""A client that goes away aborts its generation, streaming or not (fake TritonLLMClient)."""
from __future__ import annotations

import time

import httpx
import pytest

from client.fake_client import FakeLLMClient
from client.shim import ShimSettings, create_app
from client.shim.background import BackgroundServer


@pytest.fixture(scope="module")
def fake():
    return FakeLLMClient(delay=0.05)            # ~80 tokens: 4 s per full answer


@pytest.fixture(scope="module")
def server(fake):
    with BackgroundServer(create_app(ShimSettings(model_name="tiny", disconnect_poll_s=0.05),
                                     client=fake)) as srv:
        yield srv


def wait_for(pred, timeout=3.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_stream_closed_mid_way_aborts(server, fake):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True}
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            rid = r.headers["x-request-id"]
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any('"content"' in g for g in got)
        t0 = time.monotonic()                   # leaving the block closes the connection
    assert wait_for(lambda: rid in fake.aborted), "generation was not aborted"
    assert time.monotonic() - t0 < 1.0
    assert rid not in fake.finished


def test_non_streaming_abandoned_aborts(server, fake):
    before = len(fake.calls)
    body = {"model": "tiny", "prompt": "x", "max_tokens": 80}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    t0 = time.monotonic()
    assert wait_for(lambda: len(fake.calls) > before and fake.calls[before]["request_id"] in fake.aborted)
    assert time.monotonic() - t0 < 1.0
    assert fake.calls[before]["stream"] is False


def test_finished_requests_are_not_aborted(server, fake):
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2,
                                                         "stream": True}, timeout=10)
    assert r.text.endswith("data: [DONE]\n\n")
    rid = r.headers["x-request-id"]
    assert rid in fake.finished and rid not in fake.aborted


def test_a_cancelled_handler_waits_for_its_inner_task_to_clean_up():
    """Ray Serve cancels the handler when its client leaves: until_disconnect must not return
    control (and let the caller close the stream it reads) while the inner task is still unwinding."""
    import asyncio

    from client.shim.generation import until_disconnect

    class Connected:
        async def is_disconnected(self):
            return False

    async def scenario():
        cleaned = asyncio.Event()

        async def work():
            try:
                await asyncio.sleep(30)
            finally:
                await asyncio.sleep(0.05)      # cleanup that takes a moment
                cleaned.set()

        outer = asyncio.ensure_future(until_disconnect(Connected(), work(), poll_s=0.01))
        await asyncio.sleep(0.05)
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        return cleaned.is_set()

    assert asyncio.run(scenario())
