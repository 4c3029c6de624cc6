"""SSE backpressure: stalled readers are cut off after the write timeout and their generations
aborted; a reader that keeps reading gets everything. (The real-stack version, with RSS and KV
usage, is tests/e2e/test_shim_stalled_readers.py.)"""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from client.fake_client import FakeLLMClient
from client.shim import ShimSettings, create_app
from client.shim.background import BackgroundServer

REPLY = "abcdefghij" * 20000                      # 10,000 pieces of 20: megabytes of SSE per request


@pytest.fixture
def stack(request):
    # the write timeout: 1 s by default; a test may ask for another one (indirect parametrize)
    write_timeout = getattr(request, "param", 1.0)
    fake = FakeLLMClient(reply=REPLY, piece=20)
    app = create_app(ShimSettings(model_name="m", stream_write_timeout_s=write_timeout), client=fake)
    with BackgroundServer(app) as srv:
        yield srv, fake, app


def stalled_request(host: str, port: int, body: dict) -> socket.socket:
    """Send a request and never read the answer (a tiny receive window fills at once)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, port))
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return s


def test_stalled_readers_are_cut_off_and_aborted(stack):
    srv, fake, app = stack
    body = {"model": "m", "prompt": "x", "n": 4, "stream": True}
    socks = [stalled_request(srv.host, srv.port, body) for _ in range(8)]
    try:
        # the aborts and the slot releases happen as each handler unwinds: wait for both
        deadline = time.monotonic() + 60
        while (len(fake.aborted) < 8 or app.state.in_flight._open) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(fake.aborted) == 8 and not fake.finished      # none ran to the end
        assert app.state.in_flight._open == {}
        # the server closed them: after draining what was buffered, each socket reads EOF
        for s in socks:
            s.settimeout(60)
            while s.recv(1 << 20):
                pass
    finally:
        for s in socks:
            s.close()
    r = httpx.post(srv.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 3})
    assert r.status_code == 200


@pytest.mark.parametrize("stack", [5.0], indirect=True)
def test_a_reader_that_keeps_reading_is_not_cut_off(stack):
    # A 5 s write timeout against 0.5 s pauses: on a loaded host the reading thread (which shares
    # the GIL with the server here) lags on top of its pause, and a 1 s timeout left it 0.5 s.
    srv, fake, _ = stack
    body = {"model": "m", "prompt": "x", "n": 2, "stream": True}
    chunks, last = 0, None
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            last = line or last
            if line.startswith("data: {"):
                chunks += 1
                if chunks % 2000 == 0:
                    time.sleep(0.5)               # slow (the writes block), but below the write timeout
        assert last == "data: [DONE]"
    assert chunks == 2 * len(REPLY) // 20 and fake.finished and not fake.aborted
