"""A client that goes away aborts its generation, streaming or not (fake TritonLLMClient).

No wall-clock bounds (a loaded CI host is 5-10x slower): an abort that came late or never shows as
the generation finishing (the fake's full answer takes ~4 s), which ``fake.finished`` records."""
from __future__ import annotations

import socket
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


def wait_for(pred, timeout=60.0):
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
    # leaving the block closed the connection
    assert wait_for(lambda: rid in fake.aborted or rid in fake.finished), "generation neither aborted nor ended"
    assert rid in fake.aborted and rid not in fake.finished      # stopped mid-way, not run to the end


def test_non_streaming_abandoned_aborts(server, fake):
    before = len(fake.calls)
    body = b'{"model": "tiny", "prompt": "x", "max_tokens": 80}'
    # A raw connection, closed once the generation started (a fixed client timeout could close it
    # before the shim called the client at all on a slow host)
    with socket.create_connection((server.host, server.port), timeout=60) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert wait_for(lambda: len(fake.calls) > before), "the generation did not start"
    rid = fake.calls[before]["request_id"]
    assert wait_for(lambda: rid in fake.aborted or rid in fake.finished), "generation neither aborted nor ended"
    assert rid in fake.aborted and rid not in fake.finished
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
