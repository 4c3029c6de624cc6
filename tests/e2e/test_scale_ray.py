"""Ray Serve scale-out, locally: the shim as ingress, 2 TritonReplica replicas of the tiny model and
one FallbackReplica (the same tiny checkpoint served as "tiny-lite": the lighter model's stand-in).

Shows (a) a multi-turn conversation returns to the replica holding its KV (cached_tokens > 0 on
follow-ups, prefix hits in that replica's own Triton metrics, the router counts "prefix"
decisions), (b) streaming across the hop and a client hanging up mid-stream (the abort reaching
the engine, through the tenant-scoped explicit abort), (c) degradation: with the primary saturated,
requests that opt in (``x-allow-fallback: 1``) are served by the fallback model within the
queue-time threshold and say so, the others stay on the primary, and (d) failover under a
16-stream load: one replica's tritonserver is killed; streams it had started end with an error
event, every request that had not started completes on the other replica, and Ray replaces the
dead replica, which then takes traffic. One Ray cluster and one app for the module; sized for 2
cores: fractional CPUs, short generations.
"""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import threading
import time
import urllib.request
from collections import Counter

import pytest

pytestmark = pytest.mark.e2e
ray = pytest.importorskip("ray")

from tests.conftest import E2E_ENGINE_OPTIONS, model_dir  # noqa: E402
from tests.e2e.ray_app import replica_tritonservers, serve_app  # noqa: E402

APP = "tllm"
FALLBACK_MAX_ONGOING = 4            # primary ongoing requests per replica past which it is saturated
FALLBACK_QUEUE_S = 5.0              # queue-time threshold: a degraded request is served within it
SYSTEM = ("You are a careful assistant for the scale-out test. Answer briefly and stay on topic; "
          "this system prompt is long enough to fill several KV blocks of sixteen tokens each.")


def _replica_servers() -> dict[str, dict]:
    """replica unique id -> {"server_pid", "metrics_port"} of our live primary replicas' servers
    (a replica's workdir is named after it: triton_llm/scale/replica.py)."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{APP}#TritonReplica#")]
    alive = {n.rsplit("#", 1)[1] for n in names}
    out = {}
    for srv in replica_tritonservers():
        rid = next((r for r in alive if f"tllm-replica-{r}-" in srv["repo"]), None)
        if rid is not None:
            out[rid] = {"server_pid": srv["pid"], "metrics_port": srv["metrics_port"]}
    return out


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


@pytest.fixture(scope="module")
def scaled():
    from triton_llm.scale.app import ScaleConfig

    # 640 KV blocks a replica: the 8 long requests a replica holds in the saturation and failover
    # tests fit without preemption (8 x 60 blocks), which only made each of them slower and
    # longer on a loaded host; the 16-choice stream of the hang-up tests still does not (976).
    primary = {**E2E_ENGINE_OPTIONS, "num_kv_blocks": "640"}
    cfg = ScaleConfig(model_dir=str(model_dir("tiny")), engine_options=primary,
                      replicas=2, replica_cpus=0.5, ingress_cpus=0.25, imbalance=4,
                      health_check_period_s=1.0, graceful_shutdown_s=5.0,
                      fallback_model_dir=str(model_dir("tiny")),
                      fallback_engine_options=dict(E2E_ENGINE_OPTIONS), fallback_replicas=1,
                      fallback_max_ongoing=FALLBACK_MAX_ONGOING, fallback_queue_s=FALLBACK_QUEUE_S,
                      fallback_model_name="tiny-lite", shim={"model_name": "tiny"})
    # Engine threads at the test's own nice value, not the launcher's -19: three servers and Ray
    # share 2 cores here, and while both primaries generate (the saturation and failover tests) two
    # engine threads at -19 took both cores from everything else; Triton's Python backend then
    # found a stub unresponsive ("Stub process 'engine_0_0' is not healthy", HTTP 500) or aborted
    # with boost::interprocess::lock_exception (seen beside a CPU burner and on a shared host).
    nice = str(os.getpriority(os.PRIO_PROCESS, 0))
    with serve_app(cfg, APP, env={"TRITON_LLM_ENGINE_NICE": nice}) as base:
        yield base


def _post(base: str, body: dict, timeout: float = 120, headers: dict | None = None,
          with_headers: bool = False):
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out = json.loads(r.read())
        return (out, dict(r.headers.items())) if with_headers else out


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
    deadline, gained = time.monotonic() + 60, 0.0
    while time.monotonic() < deadline and gained < 1:
        time.sleep(0.5)
        gained = sum(_metric(s["metrics_port"], "llm_requests_aborted_total") - before.get(rid, 0)
                     for rid, s in _replica_servers().items())
    assert gained >= 1, "the replica's engine never saw the abort"




def _sse(base: str, body: dict, rec: dict, *, headers: dict | None = None, timeout: float = 45,
         stop: threading.Event | None = None) -> None:
    """One streaming request; ``rec`` gets its outcome: "done" ([DONE] after a finish reason),
    "error_event" (an SSE error event, then the stream ended), "http_<status>", "hang" (no byte
    for ``timeout`` s), "eof" (ended without either), "stopped" (we hung up: ``stop`` set)."""
    host, port = base.rsplit("/", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    rec.update(events=0, sent=time.monotonic())
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json", "Connection": "close", **(headers or {})})
        resp = conn.getresponse()
        rec["headers"] = dict(resp.getheaders())
        if resp.status != 200:
            rec["outcome"] = f"http_{resp.status}"
            rec["body"] = resp.read()[:300]
            return
        while True:
            if stop is not None and stop.is_set():
                rec["outcome"] = "stopped"
                return
            line = resp.readline()                  # the body, de-chunked: b"" at its end
            if not line:
                rec.setdefault("outcome", "eof")
                return
            if line.startswith(b"data: [DONE]"):
                rec["outcome"] = "done" if rec.get("finish") else "eof"
                return
            elif line.startswith(b"data: "):
                ev = json.loads(line[6:])
                if "error" in ev:
                    rec["outcome"], rec["error"] = "error_event", ev["error"]   # the stream must end
                    continue
                rec.setdefault("first", time.monotonic())
                rec["id"], rec["model"] = ev["id"], ev.get("model")
                rec["events"] += 1
                rec["finish"] = rec.get("finish") or any(c.get("finish_reason") for c in ev["choices"])
    except (TimeoutError, OSError) as exc:
        rec["outcome"] = "hang" if isinstance(exc, TimeoutError) else f"oserror {exc}"
    finally:
        rec["ended"] = time.monotonic()
        conn.close()


def _start(base: str, bodies: list[dict], **kw) -> tuple[list[dict], list[threading.Thread]]:
    recs = [{} for _ in bodies]
    threads = [threading.Thread(target=_sse, args=(base, b, r), kwargs=kw, daemon=True)
               for b, r in zip(bodies, recs)]
    for t in threads:
        t.start()
    return recs, threads


def _wait(pred, timeout: float, what: str, step: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(step)


def _conv(i: int, tag: str, max_tokens: int) -> dict:
    return {"model": "tiny", "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "messages": [{"role": "system", "content": SYSTEM + f" {tag} {i}."},
                                           {"role": "user", "content": f"Tell me about item {i}."}]}


HOLD_READ_S = 900      # only a hang guard: an overloaded host takes minutes for one long answer


def _hold(base: str, body: dict, rec: dict, stop: threading.Event) -> None:
    """Non-streaming requests kept open one after another until ``stop`` (cheap for the ingress: one
    response each), so the primary stays saturated however fast the engine finishes a request; the
    main thread sets ``stop`` and hangs the open one up with ``rec["conn"].sock.shutdown``. An
    answer is awaited for as long as the host needs (no deadline but the hang guard): a request
    that ended in anything but 200 before ``stop`` is a failure, recorded in ``rec["failed"]``."""
    host, port = base.rsplit("/", 1)[1].split(":")
    rec.update(done=0, failed=[])
    while not stop.is_set():
        conn = rec["conn"] = http.client.HTTPConnection(host, int(port), timeout=HOLD_READ_S)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            text = resp.read()
            if resp.status == 200:
                rec["done"] += 1
            elif not stop.is_set():
                rec["failed"].append(f"HTTP {resp.status}: {text[:300]!r}")
        except OSError as exc:
            if not stop.is_set():                   # after stop: our own hang-up
                rec["failed"].append(f"{type(exc).__name__}: {exc}")
        finally:
            conn.close()


def _hang_up(holds: list[dict], stop: threading.Event, threads: list[threading.Thread]) -> None:
    stop.set()
    deadline = time.monotonic() + 120
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        for h in holds:
            conn = h.get("conn")
            if conn is not None and conn.sock is not None:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)   # hang up: the shim aborts it
                except OSError:
                    pass
        for t in threads:
            t.join(0.2)


def _queue_times(port: int) -> tuple[float, float]:
    """(requests, requests queued at most FALLBACK_QUEUE_S) in the engine's
    ``llm_queue_time_seconds`` histogram of the server on metrics ``port``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    count = sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("llm_queue_time_seconds_count"))
    within = sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("llm_queue_time_seconds_bucket")
                 and (le := re.search(r'le="([^"]+)"', x)) and float(le.group(1)) == FALLBACK_QUEUE_S)
    return count, within


def _fallback_metrics_port() -> int:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{APP}#FallbackReplica#")]
    assert len(names) == 1, names
    rid = names[0].rsplit("#", 1)[1]
    return next(s["metrics_port"] for s in replica_tritonservers() if f"tllm-replica-{rid}-" in s["repo"])


def test_a_saturated_primary_degrades_only_requests_that_opt_in(scaled):
    # 16 long requests kept open on 2 replicas: 8 per replica > FALLBACK_MAX_ONGOING saturates the
    # primary. Before each opted-in request the ingress must count at least 12 of them open, so the
    # state it decides on is saturated unless 4 more of them end within that moment (their lengths
    # differ, so they do not end on one step: with equal lengths a replica's batch ended together
    # and the ingress saw only 8 ongoing). No bound on how long anything takes: a loaded host is
    # slow, and the engines' own queue times say whether the fallback served within its threshold.
    holds, stop = [{} for _ in range(16)], threading.Event()
    threads = [threading.Thread(target=_hold, args=(scaled, {**_conv(i, "Saturating", 500 + 25 * i), "stream": False},
                                                    h, stop), daemon=True) for i, h in enumerate(holds)]
    fallback_port = _fallback_metrics_port()
    queued_before = _queue_times(fallback_port)
    for t in threads:
        t.start()

    def saturated() -> None:
        _wait(lambda: _stats(scaled)["ongoing_primary"] >= 12, 300, "the saturating requests to open", 0.1)

    try:
        saturated()
        before = _stats(scaled)["fallbacks"].get("primary_saturated", 0)
        quick = {"model": "tiny", "max_tokens": 8, "temperature": 0,
                 "messages": [{"role": "user", "content": "Degrade me if you must."}]}
        allow = {"x-allow-fallback": "1"}
        degraded = []
        for _ in range(3):
            saturated()
            t0 = time.monotonic()
            out, hdrs = _post(scaled, quick, headers=allow, with_headers=True, timeout=HOLD_READ_S)
            degraded.append((time.monotonic() - t0, out, {k.lower(): v for k, v in hdrs.items()}))
        for _, out, hdrs in degraded:
            assert out["model"] == "tiny-lite" and hdrs["x-served-model"] == "tiny-lite", (out, hdrs)
            assert hdrs["x-fallback-reason"] == "primary_saturated"
            assert out["choices"][0]["finish_reason"] == "length"
        rec: dict = {}
        saturated()
        _sse(scaled, {**quick, "stream": True}, rec, headers=allow, timeout=HOLD_READ_S)   # a stream degrades too
        assert rec["outcome"] == "done" and rec["model"] == "tiny-lite", rec
        assert rec["headers"].get("x-served-model") == "tiny-lite"
        t0 = time.monotonic()
        out, hdrs = _post(scaled, quick, with_headers=True, timeout=HOLD_READ_S)   # not opted in: the primary
        waited = time.monotonic() - t0
        assert out["model"] == "tiny" and {k.lower(): v for k, v in hdrs.items()}["x-served-model"] == "tiny"
        stats = _stats(scaled)
        assert stats["fallbacks"].get("primary_saturated", 0) - before == 4
        assert stats["running_primaries"] == 2             # read from Serve's status in the ingress
        assert not [f for h in holds for f in h.get("failed", [])], holds    # no saturating request failed
        # The fallback engine queued each degraded request within the threshold (its histogram
        # reaches Prometheus at the next stats poll: wait for the 4 to be counted).
        _wait(lambda: _queue_times(fallback_port)[0] - queued_before[0] >= 4, 60,
              "the fallback's queue times", 0.5)
        count, within = _queue_times(fallback_port)
        assert count - queued_before[0] == 4 and within - queued_before[1] == 4, (queued_before, count, within)
        print("degradation:", json.dumps({"fallback_s": [round(d[0], 2) for d in degraded],
                                          "primary_not_opted_in_s": round(waited, 2),
                                          "saturating_requests_completed": sum(h["done"] for h in holds)}))
    finally:
        _hang_up(holds, stop, threads)
    _wait(lambda: _stats(scaled)["ongoing_primary"] == 0, 120, "the hung-up requests to close", 0.5)
    out = _post(scaled, {"model": "tiny", "max_tokens": 4, "temperature": 0,
                         "messages": [{"role": "user", "content": "calm again"}]},
                headers={"x-allow-fallback": "1"})
    assert out["model"] == "tiny"                                 # no longer saturated: the primary


def _open_streams(recs: list[dict]) -> list[dict]:
    return [r for r in recs if "first" in r and "ended" not in r]


STREAM_READ_S = 120    # a failover stream with no byte for this long hangs (a guard: a loaded host is slow)


def _freeze_the_busiest(base: str, servers: dict, recs: list[dict]) -> tuple[str, Counter]:
    """Stop (SIGSTOP) the replica server with the most open streams and return it with the open
    streams per replica once it is frozen: at least one of them is the frozen one's. A frozen
    server sends nothing more, so its streams stay open until it is killed or continued."""
    for _ in range(5):
        _wait(lambda: len(_open_streams(recs)) >= 4, 180, "4 streams to be open", 0.05)   # a loaded host: slow
        served = _stats(base)["served"]
        busiest = Counter(served.get(r["id"]) for r in _open_streams(recs))
        victim = max(servers, key=lambda rid: busiest[rid])
        os.killpg(servers[victim]["server_pid"], signal.SIGSTOP)
        time.sleep(0.5)                             # the chunks it had sent reach the client
        at_kill = Counter(served.get(r["id"]) for r in _open_streams(recs))
        if at_kill[victim]:
            return victim, at_kill
        os.killpg(servers[victim]["server_pid"], signal.SIGCONT)   # its streams had ended: again
    pytest.fail(f"no replica kept an open stream through its freeze: {busiest}")


def test_killing_a_replicas_tritonserver_under_a_16_stream_load(scaled):
    """Failover: streams the dead server had started end with an error event (never hang); every
    request that had not started completes on the other replica; Ray marks the replica unhealthy,
    replaces it, and the new replica takes traffic."""
    from ray import serve

    servers = _replica_servers()
    assert len(servers) == 2, servers
    # The kill must hit open streams on any CPU, however fast: as soon as 4 streams are open at the
    # client, the replica serving most of them is frozen (SIGSTOP on its process group), so none
    # of its streams can end any more; once the chunks already in flight have arrived, the client
    # sees which of its streams are still open, and only then is it killed. (Waiting for a number
    # of first events found the victim's streams finished on a fast host: CI at 606081b and later.)
    retries_before = sum(_stats(scaled)["retries"].values())
    bodies = [_conv(i, "Failover", 896) for i in range(16)]
    recs, threads = _start(scaled, bodies, timeout=STREAM_READ_S)
    victim, at_kill = _freeze_the_busiest(scaled, servers, recs)
    with contextlib.suppress(ProcessLookupError):         # Ray may have stopped the frozen one first
        os.killpg(servers[victim]["server_pid"], signal.SIGKILL)   # the server's own process group
    t_kill = time.monotonic()
    # Right after the kill, before any health check: the same conversations again (affinity sends
    # about half to the dead replica), none started yet.
    recs2, threads2 = _start(scaled, [{**b, "max_tokens": 16} for b in bodies], timeout=STREAM_READ_S)
    states: list[tuple[float, str, dict]] = []
    t_replaced = None
    while time.monotonic() - t_kill < 300:                 # Ray marks it unhealthy, then replaces it (a guard)
        dep = serve.status().applications[APP].deployments["TritonReplica"]
        states.append((round(time.monotonic() - t_kill, 1), str(dep.status), dict(dep.replica_states)))
        now = _replica_servers()
        if victim not in now and len(now) == 2 and dep.replica_states.get("RUNNING", 0) == 2:
            t_replaced = time.monotonic()
            break
        time.sleep(0.5)
    for t in threads + threads2:
        t.join(STREAM_READ_S)
    assert not any(t.is_alive() for t in threads + threads2), "a stream hung"
    stats = _stats(scaled)
    served = stats["served"]
    # "Started" is the server's view: a stream whose first chunk had left the dead replica. The
    # client may see that chunk only after the kill (a busy ingress), so a started stream is
    # one with events before its error; a request that had not started has no event at the kill
    # and must complete elsewhere: the shim waits for a first chunk before it answers 200, so a
    # failure before any chunk would be an HTTP error here, never an error event.
    errored = [r for r in recs if r.get("outcome") == "error_event"]
    seen_before_kill = [r for r in recs if r.get("first", t_kill + 1) < t_kill]
    summary = {"at_kill": at_kill, "victim": victim, "seen_streaming_before_kill": len(seen_before_kill),
               "error_events": len(errored),
               "done": sum(r.get("outcome") == "done" for r in recs),
               "second_wave_done": sum(r.get("outcome") == "done" for r in recs2),
               "retries": sum(stats["retries"].values()) - retries_before,
               "replaced_after_s": round(t_replaced - t_kill, 1) if t_replaced else None,
               "states": [s for i, s in enumerate(states) if i == 0 or s[1:] != states[i - 1][1:]]}
    print("failover:", json.dumps(summary))
    assert t_replaced is not None, f"the dead replica was not replaced: {states[-3:]}"
    for r in recs + recs2:
        assert r.get("outcome") in ("done", "error_event"), r      # never a hang, an HTTP error or a cut stream
    assert errored, "the kill hit no open stream"
    for r in errored:                                      # only streams the dead server had started
        assert r["events"] >= 1 and served.get(r["id"]) == victim, (r, served.get(r.get("id")))
        assert r["error"]["type"] and r["error"]["message"]
    assert all(r["outcome"] == "done" for r in recs2), recs2      # none had started: all complete
    assert all(served.get(r["id"]) != victim for r in recs2)
    assert summary["retries"] >= 1, summary                # some were sent to the dead one first
    assert any(s[2].get("RUNNING", 0) < 2 or "HEALTHY" != s[1].rsplit(".", 1)[-1] for s in states), states
    new = next(iter(set(_replica_servers()) - set(servers)))
    # The new replica takes traffic again. Raw prompts with distinct first blocks (a chat
    # template's shared opening block would keep following the replica that holds it): an idle
    # router spreads new prefixes by rendezvous hash over both replicas.
    for i in range(24):
        req = urllib.request.Request(
            f"{scaled}/v1/completions", headers={"Content-Type": "application/json"},
            data=json.dumps({"model": "tiny", "max_tokens": 4, "temperature": 0,
                             "prompt": f"{i} {i} {i}: " + "a fresh prompt after the failover, " * 4}).encode())
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.loads(r.read())
        if _stats(scaled)["served"][out["id"]] == new:
            break
    else:
        pytest.fail("the replacement replica took none of 24 new prompts")
