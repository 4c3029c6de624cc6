"""A client that goes away stops its generation: aborted counter rises, KV usage returns to idle.

Through the shim (streaming and non-streaming HTTP clients that disconnect) and through the
tritonclient library (ensemble and engine), where the explicit abort request does the work that a
stream cancel cannot do inside an ensemble.
"""
from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

from client.triton_client import TritonLLMClient
from tests.e2e.settle import llm_values, settled
from tests.e2e.shim_fixtures import KEY, MODEL, metric, shim, wait_metric  # noqa: F401

pytestmark = pytest.mark.e2e

ABORTED = "llm_requests_aborted_total"
KV = "llm_kv_cache_usage_ratio"
RUNNING = "llm_num_requests_running"
FINISHED = "llm_requests_finished_total"
LONG = {"max_tokens": 900, "ignore_eos": True}
AUTH = {"Authorization": f"Bearer {KEY}"}


def idle(metrics_url: str) -> float:
    """Wait for an idle, settled engine; returns the abort counter then. Settled, not just idle
    gauges: an earlier request's abort is counted at the metrics thread's poll, after the gauges,
    and would otherwise land in this test's exact delta."""
    snap = settled(lambda: llm_values(metrics_url), ready=lambda s: s.get(RUNNING, 0) == 0 and s.get(KV, 0) == 0)
    return snap.get(ABORTED, 0.0)


def assert_aborted_and_freed(metrics_url: str, aborted_before: float, exact: bool = True) -> None:
    """No wall-clock bound (a loaded CI host is 5-10x slower): a generation that was not aborted
    runs its 900 tokens to the end and is never counted by the abort counter."""
    snap = settled(lambda: llm_values(metrics_url), ready=lambda s: s.get(ABORTED, 0) > aborted_before
                   and s.get(KV, 0) == 0 and s.get(RUNNING, 0) == 0)
    aborted = snap[ABORTED]
    assert aborted == aborted_before + 1 if exact else aborted > aborted_before


def test_stream_disconnect_aborts(shim):
    before = idle(shim.metrics_url)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on forever"}], "stream": True, **LONG}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", shim.url + "/v1/chat/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(8)]
            assert any('"content"' in g for g in got)
            # the gauge is written after a batch by the metrics thread: wait for it
            assert wait_metric(shim.metrics_url, KV, lambda v: v > 0, timeout=60) > 0
    assert_aborted_and_freed(shim.metrics_url, before)       # the connection was closed above


def test_non_streaming_abandoned_aborts(shim):
    before = idle(shim.metrics_url)
    body = json.dumps({"model": MODEL, "prompt": "go on forever", **LONG}).encode()
    host, port = shim.url.removeprefix("http://").split(":")
    # A raw connection, closed once the generation runs (not after a fixed client timeout, which
    # on a slow host could close it before the shim even sent the request on)
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        assert wait_metric(shim.metrics_url, RUNNING, lambda v: v == 1, timeout=60) == 1
    assert_aborted_and_freed(shim.metrics_url, before)


@pytest.mark.parametrize("target", ["ensemble", "engine"])
def test_tritonclient_early_exit_aborts(shim, triton_server, target):
    before = idle(triton_server.metrics_url)

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
    assert_aborted_and_freed(triton_server.metrics_url, before, exact=target == "ensemble")


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

    before = idle(triton_server.metrics_url)
    out = CtrlCAfter()
    with SyncTritonLLMClient(triton_server.grpc_url) as client:
        assert run_chat(client, max_tokens=900, inp=io.StringIO("tell me everything\n"), out=out) == 0
    assert "[stopped]" in out.getvalue()
    assert_aborted_and_freed(triton_server.metrics_url, before)


def test_finished_requests_are_not_aborted(shim, triton_server):
    idle(shim.metrics_url)
    start = settled(lambda: llm_values(shim.metrics_url))
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
    # metrics are exported off the hot path: wait until all 5 choices are counted and nothing
    # more is being written (an abort would be counted by then), instead of a fixed sleep
    done = settled(lambda: llm_values(shim.metrics_url),
                   ready=lambda s: s.get(FINISHED, 0) >= start.get(FINISHED, 0) + 5 and s.get(RUNNING, 0) == 0)
    assert done[FINISHED] == start.get(FINISHED, 0) + 5
    assert done.get(ABORTED, 0) == start.get(ABORTED, 0)


def test_a_hang_up_never_cancels_the_rpc_in_triton(tmp_path):
    """A consumer cancelled while it awaits the next response (the shim's task when its HTTP client
    hangs up) must not cancel the gRPC call: grpc.aio cancels the RPC of a read cancelled in a
    task, and Triton 2.51 then leaks the stream's state (so `llm` never unloads, ~120 KB of RSS
    each; docs/serving.md). The explicit abort stops the request instead, and the stream drains.
    Triton logs every RPC cancellation it receives at --log-verbose=1, so this server's log is
    the witness."""
    from backend.serving.launcher import TritonServer
    from tests.conftest import E2E_ENGINE_OPTIONS, model_dir
    from tests.e2e.shim_fixtures import start_shim, stop_shim

    with TritonServer(model_dir("tiny"), engine_options=E2E_ENGINE_OPTIONS, quiet=True, log_verbose=1,
                      workdir=tmp_path / "server") as server:
        before = idle(server.metrics_url)

        async def cancelled_mid_read() -> None:
            client = TritonLLMClient(server.grpc_url)
            got = asyncio.Event()

            async def consume():
                async for _chunk in client.generate(prompt="go on forever", params=LONG):
                    got.set()
            task = asyncio.create_task(consume())
            try:
                await asyncio.wait_for(got.wait(), 60)
                await asyncio.sleep(0.05)           # the task now awaits the next response
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await client.wait_aborts()
            finally:
                await client.close()

        asyncio.run(cancelled_mid_read())
        assert_aborted_and_freed(server.metrics_url, before)

        shim = start_shim(server, tmp_path)         # the same through the shim, over HTTP
        try:
            before = idle(server.metrics_url)
            body = {"model": MODEL, "messages": [{"role": "user", "content": "go on forever"}], "stream": True, **LONG}
            with httpx.Client(timeout=60) as http:
                with http.stream("POST", shim.url + "/v1/chat/completions", json=body, headers=AUTH) as r:
                    lines = r.iter_lines()
                    assert any('"content"' in next(lines) for _ in range(8))
            assert_aborted_and_freed(server.metrics_url, before)
        finally:
            stop_shim(shim.proc)
        log = server.log_path.read_text(errors="replace")
        assert "ModelStreamInferHandler" in log          # verbose logging was on: the check can fail
        cancels = [line for line in log.splitlines() if "Cancellation notification received" in line]
        assert cancels == []
