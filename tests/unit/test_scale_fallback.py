"""Degradation to the fallback model without Ray: ServeClient over scripted deployment handles,
behind the real shim app with served.py's ServedModel middleware (as the ingress builds it).

Opt-in per request (``x-allow-fallback`` header) or per key (tenant in ``fallback_tenants``); a
degraded response names the fallback model in its body (JSON and every SSE event) and in
``x-served-model``; a request that did not opt in stays on the primary; fallbacks are counted.
"""
from __future__ import annotations

import dataclasses
import json

import httpx
import pytest

from triton_llm.scale.fallback import FallbackPolicy, QueueTimeTracker
from triton_llm.scale.served import ServedModel, rename_sse
from triton_llm.scale.serve_client import ServeClient
from client.fake_client import FakeLLMClient
from client.shim import ShimSettings, create_app
from client.shim.background import BackgroundServer


class FakeHandle:
    """A DeploymentHandle's surface that ServeClient uses, serving from a FakeLLMClient."""

    def __init__(self, name: str, label: str, queue_time: float = 0.0) -> None:
        self.deployment_name, self.label, self.queue_time = name, label, queue_time
        self.fake, self.requests = FakeLLMClient(), []

    def options(self, stream: bool = True):
        return self

    @property
    def generate(self):
        return self

    def remote(self, request: dict):
        self.requests.append(request)
        return _Call(self, request)


class _Call:
    def __init__(self, handle: FakeHandle, request: dict) -> None:
        self.handle, self.request = handle, request

    async def _gen(self):
        r = self.request
        async for chunk in self.handle.fake.generate(prompt=r["prompt"], messages=r["messages"],
                                                     request_id=r["request_id"], params=r["params"],
                                                     stream=r["stream"]):
            item = dataclasses.asdict(chunk)
            if item.get("finish_reason"):
                item["metrics"] = {**(item.get("metrics") or {}), "queue_time": self.handle.queue_time}
            yield {**item, "replica": self.handle.label + "-0", "model_label": self.handle.label}

    def __aiter__(self):
        return self._gen()

    def cancel(self) -> None:
        pass


@pytest.fixture(scope="module")
def stack():
    primary, fallback = FakeHandle("TritonReplica", "primary"), FakeHandle("FallbackReplica", "fallback")
    client = ServeClient(primary, fallback=fallback, fallback_policy=FallbackPolicy(2, queue_time_s=1.0),
                         fallback_tenants={"acme"})
    client.healthy = 1

    async def healthy():
        return client.healthy
    client._healthy_primaries = healthy
    settings = ShimSettings(model_name="tiny", api_keys={"sk-acme": "acme", "sk-other": "globex"})
    app = create_app(settings, client=client)
    app.add_middleware(ServedModel, primary_name="tiny", fallback_name="tiny-lite")
    with BackgroundServer(app) as srv:
        yield srv.url, client, primary, fallback


def _chat(url: str, key: str, *, stream: bool = False, allow: bool = False) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    if allow:
        headers["x-allow-fallback"] = "1"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "stream": stream}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=30)


@pytest.fixture
def fresh(stack):
    url, client, primary, fallback = stack
    client.healthy, client.ongoing = 1, 0
    client.queue_time = QueueTimeTracker()
    client.metrics.fallbacks.clear()
    return stack


def test_healthy_primary_serves_everyone_and_says_so(fresh):
    url, client, primary, fallback = fresh
    r = _chat(url, "sk-other", allow=True)
    assert r.status_code == 200 and r.json()["model"] == "tiny"
    assert r.headers["x-served-model"] == "tiny" and "x-fallback-reason" not in r.headers
    assert not client.metrics.fallbacks


def test_no_healthy_primary_degrades_only_opted_in_requests(fresh):
    url, client, primary, fallback = fresh
    client.healthy = 0
    n_fb = len(fallback.requests)
    r = _chat(url, "sk-other", allow=True)                       # per request: the header
    assert r.status_code == 200 and r.json()["model"] == "tiny-lite"
    assert r.headers["x-served-model"] == "tiny-lite"
    assert r.headers["x-fallback-reason"] == "no_healthy_primary"
    assert r.json()["choices"][0]["message"]["content"]
    r = _chat(url, "sk-acme")                                    # per key: the tenant's policy
    assert r.json()["model"] == "tiny-lite"
    n_primary = len(primary.requests)
    r = _chat(url, "sk-other")                                   # not opted in: the primary
    assert r.json()["model"] == "tiny" and r.headers["x-served-model"] == "tiny"
    assert len(primary.requests) == n_primary + 1 and len(fallback.requests) == n_fb + 2
    assert client.metrics.fallbacks == {"no_healthy_primary": 2}


def test_saturated_primary_degrades_opted_in_streams(fresh):
    url, client, primary, fallback = fresh
    client.ongoing = 5                                           # > 2 per healthy replica
    r = _chat(url, "sk-other", stream=True, allow=True)
    assert r.status_code == 200 and r.headers["x-served-model"] == "tiny-lite"
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert len(events) > 2 and {e["model"] for e in events} == {"tiny-lite"}
    assert r.text.rstrip().endswith("data: [DONE]")
    assert client.metrics.fallbacks == {"primary_saturated": 1}
    assert _chat(url, "sk-other", stream=True).headers["x-served-model"] == "tiny"


def test_the_primarys_reported_queue_time_past_the_threshold_saturates_it(fresh):
    url, client, primary, fallback = fresh
    # No decay in this test (it has its own test with explicit clocks below): with the default 10 s
    # half-life, "> 2.9" held only if the check came within 0.5 s of the answer (a loaded CI host)
    client.queue_time = QueueTimeTracker(half_life_s=1e9)
    primary.queue_time = 3.0                                     # > queue_time_s = 1.0
    try:
        assert _chat(url, "sk-other", allow=True).json()["model"] == "tiny"   # learns it here
        assert client.queue_time.current() > 2.9
        assert _chat(url, "sk-other", allow=True).json()["model"] == "tiny-lite"
    finally:
        primary.queue_time = 0.0


def test_queue_time_tracker_decays():
    t = QueueTimeTracker(half_life_s=10)
    t.observe(4.0, now=100.0)
    t.observe(1.0, now=100.0)                                    # the max, not the latest
    assert t.current(now=100.0) == 4.0
    assert t.current(now=110.0) == pytest.approx(2.0)
    assert t.current(now=140.0) < 0.3


def test_rename_sse_keeps_non_json_lines():
    chunk = b'data: {"id":"x","model":"tiny","choices":[]}\n\ndata: [DONE]\n\n'
    out = rename_sse(chunk, "lite")
    assert json.loads(out.split(b"\n")[0][6:])["model"] == "lite" and out.endswith(b"data: [DONE]\n\n")


def test_the_running_replica_count_is_read_at_most_once_per_ttl():
    import asyncio

    client = ServeClient(FakeHandle("TritonReplica", "primary"))
    reads = []
    client._read_healthy = lambda: reads.append(1) or 2
    assert asyncio.run(client._healthy_primaries()) == 2
    assert asyncio.run(client._healthy_primaries()) == 2 and len(reads) == 1   # cached
    assert asyncio.run(client._healthy_primaries(ttl_s=0.0)) == 2 and len(reads) == 2
