"""A client that goes away stops its generation: aborted counter rises, KV usage returns to idle.

Through the shim (streaming and non-streaming HTTP clients that disconnect) and through the
tritonclient library (ensemble and engine), where the explicit abort request does the work that a
stream cancel cannot do inside an ensemble.
"""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from client.triton_client import TritonLLMClient
from tests.e2e.shim_fixtures import KEY, MODEL, metric, shim, wait_metric  # noqa: F401

pytestmark = pytest.mark.e2e

ABORTED = "llm_requests_aborted_total"
KV = "llm_kv_cache_usage_ratio"
RUNNING = "llm_num_requests_running"
LONG = {"max_tokens": 900, "ignore_eos": True}
AUTH = {"Authorization": f"Bearer {KEY}"}


def idle(metrics_url: str) -> None:
    assert wait_metric(metrics_url, RUNNING, lambda v: v == 0, timeout=60) == 0
    assert wait_metric(metrics_url, KV, lambda v: v == 0, timeout=10) == 0


def assert_aborted_and_freed(metrics_url: str, aborted_before: float, t_gone: float,
                             exact: bool = True) -> None:
    aborted = wait_metric(metrics_url, ABORTED, lambda v: v > aborted_before)
    assert aborted == aborted_before + 1 if exact else aborted > aborted_before
    assert wait_metric(metrics_url, KV, lambda v: v == 0) == 0
    assert wait_metric(metrics_url, RUNNING, lambda v: v == 0) == 0
    assert time.monotonic() - t_gone < 5


def test_stream_disconnect_aborts(shim):
    idle(shim.metrics_url)
    before = metric(shim.metrics_url, ABORTED)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on forever"}], "stream": True, **LONG}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", shim.url + "/v1/chat/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(8)]
            assert any('"content"' in g for g in got)
            assert metric(shim.metrics_url, KV) > 0
    t_gone = time.monotonic()                    # the connection is closed here
    assert_aborted_and_freed(shim.metrics_url, before, t_gone)


def test_non_streaming_abandoned_aborts(shim):
    idle(shim.metrics_url)
    before = metric(shim.metrics_url, ABORTED)
    body = {"model": MODEL, "prompt": "go on forever", **LONG}
    with pytest.raises(httpx.ReadTimeout):
        # 900 tokens of the tiny model take ~1.5 s with the fused decode step: leave well before
        httpx.post(shim.url + "/v1/completions", json=body, headers=AUTH, timeout=0.6)
    t_gone = time.monotonic()
    assert_aborted_and_freed(shim.metrics_url, before, t_gone)


@pytest.mark.parametrize("target", ["ensemble", "engine"])
def test_tritonclient_early_exit_aborts(shim, triton_server, target):
    idle(triton_server.metrics_url)
    before = metric(triton_server.metrics_url, ABORTED)

    async def go():
        client = TritonLLMClient(triton_server.grpc_url)
        try:
            if target == "ensemble":
                agen = client.generate(prompt="go on forever", params=LONG)
            else:
                agen = client.generate_ids([1, 300, 301, 302], params=LONG)
            got = 0
            async for chunk in agen:
                got += 1
                if got == 5:
                    break
            await agen.aclose()
            await client.wait_aborts()
            return got
        finally:
            await client.close()

    assert asyncio.run(go()) == 5
    # engine called directly: the stream cancel and the explicit abort race for the same request
    assert_aborted_and_freed(triton_server.metrics_url, before, time.monotonic(), exact=target == "ensemble")


def test_abort_of_unknown_request_is_harmless(triton_server):
    async def go():
        client = TritonLLMClient(triton_server.grpc_url)
        try:
            return await client.abort("no-such-request")
        finally:
            await client.close()

    assert asyncio.run(go()) is True


def test_chat_cli_ctrl_c_stops_the_answer_and_aborts(triton_server):
    import io

    from client.chat_cli import run_chat
    from client.sync_client import SyncTritonLLMClient

    class CtrlCAfter(io.StringIO):
        """Terminal output that 'receives' Ctrl-C after a few streamed pieces of the first answer."""
        def __init__(self):
            super().__init__()
            self.pieces = 0

        def write(self, s):
            if not s.startswith(("\n", "[")) and s != "\n> ":
                self.pieces += 1
                if self.pieces == 5:
                    raise KeyboardInterrupt
            return super().write(s)

    idle(triton_server.metrics_url)
    before = metric(triton_server.metrics_url, ABORTED)
    out = CtrlCAfter()
    with SyncTritonLLMClient(triton_server.grpc_url) as client:
        assert run_chat(client, max_tokens=900, inp=io.StringIO("tell me everything\n"), out=out) == 0
    assert "[stopped]" in out.getvalue()
    assert_aborted_and_freed(triton_server.metrics_url, before, time.monotonic())


def test_finished_requests_are_not_aborted(shim, triton_server):
    idle(shim.metrics_url)
    before = metric(shim.metrics_url, ABORTED)
    for stream in (False, True):
        r = httpx.post(shim.url + "/v1/completions", headers=AUTH, timeout=60,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 4, "n": 2, "stream": stream})
        assert r.status_code == 200

    async def direct():
        client = TritonLLMClient(triton_server.grpc_url)
        try:
            return [c async for c in client.generate_ids([1, 300], params={"max_tokens": 3})]
        finally:
            await client.close()

    assert asyncio.run(direct())[-1].finish_reason in ("stop", "length")
    time.sleep(1.0)                              # metrics are exported off the hot path
    assert metric(shim.metrics_url, ABORTED) == before
