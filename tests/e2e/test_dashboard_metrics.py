"""Every series the Grafana dashboard queries is exported by the running server's metrics
endpoint (after one streamed request and one abort, so every kind of metric has been touched)."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import pathlib
import time

import pytest

from load.counters import parse_prometheus

pytestmark = pytest.mark.e2e
DOCKER = pathlib.Path(__file__).resolve().parents[2] / "docker"


def _dashboard_module():
    spec = importlib.util.spec_from_file_location("make_dashboard", DOCKER / "grafana" / "make_dashboard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


async def _traffic(url: str) -> None:
    from client.triton_client import TritonLLMClient

    async with TritonLLMClient(url) as client:
        async for _ in client.generate(prompt="Hello there", params={"max_tokens": 4, "ignore_eos": True}):
            pass
        agen = client.generate(prompt="Tell me a long story", params={"max_tokens": 200, "ignore_eos": True})
        async for _ in agen:                # stop after the first piece: the client aborts it
            break
        await agen.aclose()
        await client.wait_aborts()


def test_dashboard_queries_only_exported_metrics(triton_server):
    import httpx

    asyncio.run(_traffic(triton_server.grpc_url))
    mod = _dashboard_module()
    wanted = mod.dashboard_metric_names(json.loads((DOCKER / "grafana/dashboards/llm-serving.json").read_text()))
    deadline = time.monotonic() + 60          # metrics are written by the engine's metrics thread
    while True:
        exported = set(parse_prometheus(httpx.get(triton_server.metrics_url, timeout=30).text))
        missing = sorted(wanted - exported)
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not missing, f"dashboard queries series the server does not export: {missing}"
