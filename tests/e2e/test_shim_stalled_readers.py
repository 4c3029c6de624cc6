"""Stalled SSE readers against the real stack: raw sockets that send a streaming request and never
read. The shim's writes block once the socket buffers are full; after the write timeout it cuts
each stream off and aborts its generation if it is still running, so the engine frees the blocks
(every choice ends, KV usage returns to idle) and the shim's memory stays bounded."""
from __future__ import annotations

import json
import socket
import time

import httpx
import psutil
import pytest

from tests.e2e.shim_fixtures import KEY, MODEL, metric, start_shim, stop_shim, wait_metric

pytestmark = pytest.mark.e2e

ABORTED = "llm_requests_aborted_total"
KV = "llm_kv_cache_usage_ratio"
RUNNING = "llm_num_requests_running"
FINISHED = "llm_requests_finished_total"
WRITE_TIMEOUT = 2.0
READERS = 6
# Chat chunks with 20 top logprobs are ~2 KB per token, so each request makes megabytes of SSE:
# more than the socket buffers hold (~2.5 MB on loopback), so the shim's writes block. 6 x 5
# choices fit the engine's 32 running slots, so every stream starts at once and none waits for
# another's cut and abort (with 16 choices the last four waited; beside a CPU burner on a loaded
# host two aborts timed out and those four were never cut within 300 s); 30 choices of 900 tokens
# are far more than the KV pool holds, so a request is still running when its stream is cut, and
# the abort is what ends it.
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "tell me everything"}], "n": 5,
        "max_tokens": 900, "ignore_eos": True, "logprobs": True, "top_logprobs": 20, "stream": True}


@pytest.fixture(scope="module")
def slow_shim(triton_server, tmp_path_factory):
    s = start_shim(triton_server, tmp_path_factory.mktemp("bp"),
                   extra_args=("--stream-write-timeout", str(WRITE_TIMEOUT), "--chat-db", ":memory:"))
    yield s
    stop_shim(s.proc)


def stalled(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    data = json.dumps(BODY).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s" % (KEY.encode(), len(data), data))
    return s


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2 ** 20


def cut_offs(shim) -> int:
    return shim.log().count("stream aborted")


def test_stalled_readers_are_cut_off_their_generation_ends_and_memory_stays_bounded(slow_shim):
    """Each stalled stream is cut off by the shim; a request still generating then is aborted, one
    that had finished (a fast host finishes some within the write timeout) has nothing left to
    stop: either way every choice ends, KV returns to idle, and the shim's memory stays bounded.
    The test counts what happened instead of betting on which of the two it was."""
    m = slow_shim.metrics_url
    assert wait_metric(m, RUNNING, lambda v: v == 0, timeout=60) == 0
    ref = httpx.post(slow_shim.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                     json={"model": MODEL, "prompt": "reference", "max_tokens": 8, "temperature": 0},
                     timeout=60).json()["choices"][0]["text"]
    rss_before = rss_mb(slow_shim.proc.pid)
    aborted_before, finished_before, cuts_before = metric(m, ABORTED), metric(m, FINISHED), cut_offs(slow_shim)
    start = time.monotonic()
    socks = [stalled(slow_shim.url) for _ in range(READERS)]
    peak = rss_before
    try:
        deadline = time.monotonic() + 600        # a guard: it returns once all six are cut
        while cut_offs(slow_shim) < cuts_before + READERS and time.monotonic() < deadline:
            peak = max(peak, rss_mb(slow_shim.proc.pid))
            time.sleep(0.5)
        took = time.monotonic() - start
        assert cut_offs(slow_shim) - cuts_before == READERS, slow_shim.log()[-2000:]
        # guards of 300 s: a request whose abort failed on a starved host runs to its end first
        assert wait_metric(m, RUNNING, lambda v: v == 0, timeout=300) == 0
        assert wait_metric(m, KV, lambda v: v == 0, timeout=300) == 0
        # every choice of every stalled request ended ("length", or "abort" when it was cut first)
        choices = READERS * BODY["n"]
        finished = wait_metric(m, FINISHED, lambda v: v >= finished_before + choices, timeout=300)
        assert finished - finished_before == choices
        assert metric(m, ABORTED) - aborted_before <= READERS
        # every stalled connection was closed by the shim: draining it ends in EOF
        for s in socks:
            s.settimeout(60)
            while s.recv(1 << 20):
                pass
    finally:
        for s in socks:
            s.close()
    print(f"\n{READERS} stalled readers: all cut off after {took:.1f} s; shim RSS "
          f"{rss_before:.0f} MB -> peak {peak:.0f} MB")
    assert peak - rss_before < 150, (rss_before, peak)
    again = httpx.post(slow_shim.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": MODEL, "prompt": "reference", "max_tokens": 8, "temperature": 0},
                       timeout=60).json()["choices"][0]["text"]
    assert again == ref
