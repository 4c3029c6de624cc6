"""Prefill/decode disaggregation on Ray Serve: the two roles as two kinds of replica.

One PrefillReplica (role=prefill) and one TritonReplica (role=decode) of the tiny model behind the
shim ingress (triton_llm/scale/app.py ``prefill_replicas``), KV over the TCP connector between the
two replicas' tritonservers. Shows (a) greedy outputs through the OpenAI API equal those of the
unified engine (the session's own tritonserver), streamed and not, with the requests handed over
(the decode replica's own hand-over counters, the ingress's stats), and (b) a client hanging up
mid-stream after the hand-over aborts the request in the decode replica's engine.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import pathlib
import re
import signal
import time
import urllib.request

import pytest

pytestmark = pytest.mark.e2e
ray = pytest.importorskip("ray")

from tests.conftest import E2E_ENGINE_OPTIONS, model_dir  # noqa: E402
from tests.e2e.ray_app import received_unread, replica_tritonservers, serve_app  # noqa: E402

APP = "tllm-pd"


@pytest.fixture(scope="module")
def disagg_app():
    from triton_llm.scale.app import ScaleConfig

    cfg = ScaleConfig(model_dir=str(model_dir("tiny")), engine_options=dict(E2E_ENGINE_OPTIONS),
                      replicas=1, prefill_replicas=1, replica_cpus=0.5, ingress_cpus=0.25,
                      # a check every 5 s: the hang-up test freezes the decode server for up to
                      # FREEZE_S, shorter than Ray's three failed checks before it replaces one
                      health_check_period_s=5.0, graceful_shutdown_s=5.0, shim={"model_name": "tiny"})
    with serve_app(cfg, APP) as base:
        yield base


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _post(base: str, body: dict) -> dict:
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _sse_text(base: str, body: dict) -> str:
    host, port = base.rsplit("/", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    text = []
    for line in resp.read().decode().splitlines():
        if line.startswith("data: {"):
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            text += [c["delta"].get("content") or "" for c in ev["choices"]]
    conn.close()
    return "".join(text)


def _role_servers(role: str) -> list[dict]:
    """The live replica tritonservers of ``role`` (their engine options say it)."""
    return [srv for srv in replica_tritonservers()
            if (config := pathlib.Path(srv["repo"], "engine", "config.pbtxt")).exists()
            and re.search(r'key:\s*"role",?\s*value:\s*\{\s*string_value:\s*"' + role + '"', config.read_text())]


def _role_metric(role: str, name: str, **labels) -> float:
    """Sum of ``name`` over the live replica tritonservers of ``role``."""
    total = 0.0
    for srv in _role_servers(role):
        for line in _get(f"http://127.0.0.1:{srv['metrics_port']}/metrics").splitlines():
            if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


FREEZE_S = 8.0
PROMPTS = [f"Tell me about the item number {i} in a few words." for i in range(6)]


def test_outputs_equal_the_unified_engine_and_are_handed_over(disagg_app, triton_server):
    from client.triton_client import TritonLLMClient

    async def unified_texts():
        client = TritonLLMClient(triton_server.grpc_url)
        try:
            out = []
            for p in PROMPTS:
                chunks = [c async for c in client.generate(messages=[{"role": "user", "content": p}],
                                                           params={"max_tokens": 12, "temperature": 0})]
                out.append("".join(c.text for c in chunks))
            return out
        finally:
            await client.close()

    want = asyncio.run(unified_texts())
    admitted_before = _role_metric("decode", "llm_disagg_handovers_total", outcome="admitted")
    got = []
    for i, p in enumerate(PROMPTS):
        body = {"model": "tiny", "messages": [{"role": "user", "content": p}], "max_tokens": 12, "temperature": 0}
        if i % 2:
            got.append(_sse_text(disagg_app, body))
        else:
            out = _post(disagg_app, body)
            assert out["choices"][0]["finish_reason"] == "length"
            got.append(out["choices"][0]["message"]["content"])
    assert got == want
    stats = json.loads(_get(f"{disagg_app}/scale/stats"))
    assert stats["disagg"]["handovers"] >= len(PROMPTS), stats
    deadline = time.monotonic() + 60                 # the role counters reach Prometheus in batches
    while time.monotonic() < deadline:
        admitted = _role_metric("decode", "llm_disagg_handovers_total", outcome="admitted") - admitted_before
        if admitted >= len(PROMPTS):
            break
        time.sleep(0.3)
    assert admitted >= len(PROMPTS)
    assert _role_metric("decode", "llm_disagg_transfer_bytes_total") > 0      # KV crossed over TCP


def test_hanging_up_after_the_hand_over_aborts_in_the_decode_engine(disagg_app):
    before = _role_metric("decode", "llm_requests_aborted_total")
    host, port = disagg_app.rsplit("/", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Stream a long answer."}],
            "max_tokens": 900, "ignore_eos": True, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events = 0
    while events < 2:                                # tokens after the first come from the decode side
        line = resp.fp.readline()
        assert line, "the stream ended early"
        events += line.startswith(b"data: {")
    # The decode server is frozen (SIGSTOP) while the hang-up travels (Ray's proxy, the ingress,
    # the replica, whose explicit abort then waits in the frozen server's socket), so the stream
    # cannot finish first however fast the host: on a fast CPU its 900 tokens used to. It is
    # continued once the abort's bytes are in that socket's receive queue (the replica's gRPC
    # connection sends nothing else to a server that sends nothing), not after a guessed time.
    frozen = _role_servers("decode")
    assert len(frozen) == 1, frozen
    pid, grpc_port = frozen[0]["pid"], frozen[0]["grpc_port"]
    os.killpg(pid, signal.SIGSTOP)
    try:
        unread, still = received_unread(grpc_port), time.monotonic()
        while time.monotonic() - still < 0.5:      # the replica reads what was sent, acks settle
            time.sleep(0.05)
            if received_unread(grpc_port) != unread:
                unread, still = received_unread(grpc_port), time.monotonic()
        conn.close()
        deadline = time.monotonic() + FREEZE_S     # a guard: Ray replaces a server frozen too long
        while time.monotonic() < deadline and (
                received_unread(grpc_port) <= unread
                or json.loads(_get(f"{disagg_app}/scale/stats"))["ongoing_primary"]):
            time.sleep(0.05)
        sent = received_unread(grpc_port) - unread
    finally:
        os.killpg(pid, signal.SIGCONT)
    assert sent > 0, f"no abort reached the frozen decode server within {FREEZE_S} s"
    deadline, gained = time.monotonic() + 60, 0.0
    while time.monotonic() < deadline and gained < 1:
        time.sleep(0.5)
        gained = _role_metric("decode", "llm_requests_aborted_total") - before
    assert gained >= 1, "the decode replica's engine never saw the abort"
