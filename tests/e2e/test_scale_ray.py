"""Ray Serve scale-out, locally: the shim as ingress, 2 TritonReplica replicas of the tiny model.

Shows (a) a multi-turn conversation returns to the replica holding its KV (cached_tokens > 0 on
follow-ups, prefix hits in that replica's own Triton metrics, the router counts "prefix"
decisions), (c) streaming across the hop and a client hanging up mid-stream (the abort reaching
the engine, through the tenant-scoped explicit abort), and (b) killing one replica's tritonserver: new requests still succeed and Ray
replaces the replica. Sized for 2 cores: fractional CPUs, 2 replicas, short generations.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import tempfile
import time
import urllib.request

import pytest

pytestmark = pytest.mark.e2e
ray = pytest.importorskip("ray")

from backend.serving.process_group import free_port  # noqa: E402
from tests.conftest import E2E_ENGINE_OPTIONS, model_dir  # noqa: E402

APP = "tllm"
SYSTEM = ("You are a careful assistant for the scale-out test. Answer briefly and stay on topic; "
          "this system prompt is long enough to fill several KV blocks of sixteen tokens each.")


def _replica_servers() -> dict[str, dict]:
    """replica unique id -> {"server_pid", "metrics_port"} of our live primary replicas' servers
    (a replica's workdir is named after it: backend/scale/replica.py)."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{APP}#TritonReplica#")]
    alive = {n.rsplit("#", 1)[1] for n in names}
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if not cmd or not cmd[0].endswith("tritonserver"):
            continue
        repo = next((c for c in cmd if c.startswith("--model-repository=")), "")
        rid = next((r for r in alive if f"tllm-replica-{r}-" in repo), None)
        if rid is not None:
            port = next(int(c.split("=")[1]) for c in cmd if c.startswith("--metrics-port="))
            out[rid] = {"server_pid": int(pid), "metrics_port": port}
    return out


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


@pytest.fixture(scope="module")
def scaled():
    from ray import serve

    from backend.scale.app import ScaleConfig, build_app

    port = free_port()
    started = time.time() - 1
    root = str(pathlib.Path(__file__).resolve().parents[2])
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": root}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        cfg = ScaleConfig(model_dir=str(model_dir("tiny")), engine_options=dict(E2E_ENGINE_OPTIONS),
                          replicas=2, replica_cpus=0.5, ingress_cpus=0.25, imbalance=4,
                          health_check_period_s=1.0, graceful_shutdown_s=5.0,
                          shim={"model_name": "tiny"})
        serve.run(build_app(cfg), name=APP, route_prefix="/", blocking=False)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            st = serve.status().applications.get(APP)
            if st is not None and st.status == "RUNNING":
                break
            time.sleep(1)
        else:
            pytest.fail(f"the Ray Serve app did not start: {serve.status()}")
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()                     # replicas' __del__ stop their tritonservers
        finally:
            ray.shutdown()
            # Ray does not always run a replica's __del__ (killed, replaced): its server dies with
            # it, its workdir stays; remove this run's.
            for d in pathlib.Path(tempfile.gettempdir()).glob("tllm-replica-*"):
                if d.stat().st_mtime >= started:
                    shutil.rmtree(d, ignore_errors=True)


def _post(base: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _stats(base: str) -> dict:
    with urllib.request.urlopen(f"{base}/scale/stats", timeout=10) as r:
        return json.loads(r.read())


def _chat(base: str, messages: list[dict]) -> dict:
    return _post(base, {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0})


def test_a_conversation_returns_to_the_replica_holding_its_kv(scaled):
    servers = _replica_servers()
    assert len(servers) == 2, servers
    hits_before = {rid: _metric(s["metrics_port"], "llm_prefix_cache_hits_total") for rid, s in servers.items()}
    convs = {c: [{"role": "system", "content": SYSTEM + f" Conversation {c}."}] for c in range(4)}
    where: dict[int, set] = {c: set() for c in convs}
    cached = []
    for turn in range(3):
        for c, msgs in convs.items():             # interleaved, as a real workload
            msgs.append({"role": "user", "content": f"Turn {turn} of conversation {c}: tell me more."})
            out = _chat(scaled, msgs)
            msgs.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})
            where[c].add(_stats(scaled)["served"][out["id"]])
            if turn:
                cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert all(len(r) == 1 for r in where.values()), where        # each conversation stayed put
    assert all(n > 0 for n in cached), cached                     # and found its KV there
    routers = _stats(scaled)["routers"]
    assert sum(r["decisions"].get("prefix", 0) for r in routers) >= 8, routers
    gained = {rid: _metric(s["metrics_port"], "llm_prefix_cache_hits_total") - hits_before[rid]
              for rid, s in servers.items()}
    for rids in where.values():
        assert gained[next(iter(rids))] > 0, gained               # the replica's own cache hit


def _stream_and_hang_up(base: str, body: dict, events: int = 5) -> None:
    import http.client

    host, port = base.rsplit("/", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type", "").startswith("text/event-stream")
    seen = []
    while len(seen) < events:                     # streamed events cross the hop as they are made
        line = resp.fp.readline()
        assert line, f"stream ended early after {seen}"
        if line.startswith(b"data: "):
            seen.append(json.loads(line[6:]))
    assert seen[0]["object"] == "chat.completion.chunk"
    conn.close()                                  # the client goes away mid-stream


LONG = {"model": "tiny", "messages": [{"role": "user", "content": "Stream a long answer."}],
        "max_tokens": 960, "n": 16, "temperature": 0, "ignore_eos": True, "stream": True}  # seconds


def test_streaming_across_the_hop_and_hanging_up(scaled):
    _stream_and_hang_up(scaled, LONG)
    full = _post(scaled, {**LONG, "stream": False, "max_tokens": 6, "n": 1})   # the stack still serves
    assert full["choices"][0]["finish_reason"] == "length"


def test_hanging_up_aborts_the_request_in_the_replicas_engine(scaled):
    before = {rid: _metric(s["metrics_port"], "llm_requests_aborted_total")
              for rid, s in _replica_servers().items()}
    _stream_and_hang_up(scaled, LONG)
    deadline, gained = time.monotonic() + 20, 0.0
    while time.monotonic() < deadline and gained < 1:
        time.sleep(0.5)
        gained = sum(_metric(s["metrics_port"], "llm_requests_aborted_total") - before.get(rid, 0)
                     for rid, s in _replica_servers().items())
    assert gained >= 1, "the replica's engine never saw the abort"


def test_killing_a_replicas_tritonserver_fails_over_and_is_replaced(scaled):
    from ray import serve

    servers = _replica_servers()
    victim, info = sorted(servers.items())[0]
    os.killpg(info["server_pid"], signal.SIGKILL)          # the server's own process group
    outs = [_chat(scaled, [{"role": "system", "content": SYSTEM},
                           {"role": "user", "content": f"after the kill {i}"}]) for i in range(6)]
    assert all(o["choices"][0]["finish_reason"] in ("stop", "length") for o in outs)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:                     # Ray replaces the unhealthy replica
        now = _replica_servers()
        st = serve.status().applications[APP].deployments["TritonReplica"]
        if victim not in now and len(now) == 2 and st.replica_states.get("RUNNING", 0) == 2:
            break
        time.sleep(2)
    else:
        pytest.fail(f"the dead replica was not replaced: {_replica_servers()} {serve.status()}")
