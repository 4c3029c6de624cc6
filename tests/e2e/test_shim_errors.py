"""Every error status of the shim with its OpenAI JSON shape, against real servers.

429 is real: a second tritonserver with ``max_num_seqs=1, max_waiting=1`` is filled by two long
requests, so a third is refused by the engine's bounded queue.
"""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from backend.serving.launcher import TritonServer
from client.shim.background import free_port
from tests.conftest import model_dir
from tests.e2e.shim_fixtures import KEY, MODEL, sdk, shim, start_shim, stop_shim  # noqa: F401

pytestmark = pytest.mark.e2e

CHAT = [{"role": "user", "content": "hi"}]


def err(exc_info) -> dict:
    body = exc_info.value.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
])
def test_400_names_the_param(sdk, kwargs, param):
    with pytest.raises(openai.BadRequestError) as ei:
        sdk.chat.completions.create(model=MODEL, messages=CHAT, **kwargs)
    e = err(ei)
    assert e["type"] == "invalid_request_error" and e["param"] == param, e


def test_400_context_overflow_says_limit_and_counts(sdk):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as ei:
            sdk.completions.create(model=MODEL, prompt="word " * 1500, max_tokens=4, stream=stream)
        e = err(ei)
        assert e["param"] == "prompt" and "1024" in e["message"], e
        assert any(ch.isdigit() for ch in e["message"].replace("1024", ""))
    with pytest.raises(openai.BadRequestError) as ei:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 1500}])
    assert err(ei)["param"] == "messages"


def test_400_bad_shape(shim):
    r = httpx.post(shim.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": MODEL, "messages": [{"content": "no role"}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")


def test_401(shim):
    bad = openai.OpenAI(base_url=shim.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as ei:
        bad.chat.completions.create(model=MODEL, messages=CHAT)
    assert err(ei)["code"] == "invalid_api_key"
    assert httpx.get(shim.url + "/v1/models").status_code == 401


def test_404(sdk):
    with pytest.raises(openai.NotFoundError) as ei:
        sdk.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert err(ei)["code"] == "model_not_found" and err(ei)["param"] == "model"


def test_503_when_triton_is_not_there(triton_server, tmp_path):
    dead = start_shim(triton_server, tmp_path, grpc_url=f"127.0.0.1:{free_port()}")
    try:
        client = openai.OpenAI(base_url=dead.url + "/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.InternalServerError) as ei:
            client.chat.completions.create(model=MODEL, messages=CHAT)
        assert ei.value.status_code == 503 and err(ei)["code"] == "service_unavailable"
        with pytest.raises(openai.InternalServerError) as ei:
            client.completions.create(model=MODEL, prompt="x", stream=True)
        assert ei.value.status_code == 503
        assert httpx.get(dead.url + "/ready").status_code == 503
        assert httpx.get(dead.url + "/health").status_code == 200
    finally:
        stop_shim(dead.proc)


def test_429_with_retry_after_when_the_queue_is_full(tmp_path):
    """Four long requests at once against one running slot and one waiting slot: the engine's
    bounded queue refuses at least one of them with 429 + Retry-After."""
    opts = {"num_kv_blocks": "128", "max_num_seqs": "1", "max_waiting": "1", "num_threads": "1"}
    with TritonServer(model_dir("tiny"), engine_options=opts, quiet=True) as server:
        s = start_shim(server, tmp_path)
        stop = threading.Event()
        answers: list[tuple[int, dict, dict | None]] = []
        lock = threading.Lock()

        def request(stream: bool):
            body = {"model": MODEL, "prompt": "x", "max_tokens": 900, "ignore_eos": True, "stream": stream}
            # an admitted non-streaming request answers only at the end: give up on it after 30 s
            # (the disconnect aborts it); a refusal comes at once either way
            with httpx.Client(timeout=120 if stream else 30) as http:
                try:
                    with http.stream("POST", s.url + "/v1/completions", json=body,
                                     headers={"Authorization": f"Bearer {KEY}"}) as r:
                        error = json.loads(r.read()) if r.status_code != 200 else None
                        with lock:
                            answers.append((r.status_code, dict(r.headers), error))
                        stop.wait(60)            # an admitted stream stays open until the end
                except httpx.ReadTimeout:
                    with lock:
                        answers.append((0, {}, None))

        threads = [threading.Thread(target=request, args=(i % 2 == 0,), daemon=True) for i in range(4)]
        try:
            for t in threads:
                t.start()
            deadline = time.monotonic() + 60
            while not any(a[0] == 429 for a in answers) and time.monotonic() < deadline:
                time.sleep(0.05)
            refused = [a for a in answers if a[0] == 429]
            assert refused, f"no 429 among {[a[0] for a in answers]}"
            for _status, headers, error in refused:
                assert int(headers["retry-after"]) >= 1
                assert set(error["error"]) == {"message", "type", "param", "code"}
                assert error["error"]["type"] == "rate_limit_error"
                assert error["error"]["code"] == "rate_limit_exceeded"
            assert all(a[0] in (0, 200, 429) for a in answers)
        finally:
            stop.set()                           # admitted streams disconnect: the shim aborts them
            for t in threads:
                t.join(timeout=60)
            stop_shim(s.proc)


def test_issue_19_requests_are_quick_400s(shim):
    """Measured in issue 19: ``n: 1000000000`` made the shim hang and grow to 23 GB (a choice
    array built before the server could refuse), ``max_tokens: 2**63`` was a bare 500 (the gRPC
    library's int64). Both are now 400s from the shim, at once, naming the field."""
    import psutil

    rss = psutil.Process(shim.proc.pid).memory_info().rss
    h = {"Authorization": f"Bearer {KEY}"}
    for path, body in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "hi"})):
        for field, value in (("n", 1_000_000_000), ("max_tokens", 2 ** 63), ("seed", 2 ** 64),
                             ("top_k", 2 ** 63), ("logprobs", 10 ** 6) if "prompt" in body else
                             ("top_logprobs", 10 ** 6)):
            for stream in (False, True):
                # no wall-clock bound (a loaded CI host is 5-10x slower): a hang times out at 30 s,
                # a choice array built before refusing shows in the RSS below
                r = httpx.post(shim.url + path, headers=h, timeout=30,
                               json={"model": MODEL, **body, field: value, "stream": stream})
                assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert psutil.Process(shim.proc.pid).memory_info().rss - rss < 50 * 2 ** 20
