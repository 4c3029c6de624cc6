"""Key policies: the keys-file options, the priority ceiling, and per-key concurrency limits."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from client.errors import InvalidRequestError
from client.fake_client import FakeLLMClient
from client.shim import ShimSettings, create_app
from client.shim.background import BackgroundServer
from client.shim.settings import parse_key_lines
from client.shim.tenants import KeyPolicy, default_tenant

URGENT, LIMITED, PLAIN = "sk-urgent", "sk-limited", "sk-plain"
KEYS_FILE = f"""
{URGENT}:ops priority=-5
{LIMITED}:acme max_concurrent=2 priority=3
{PLAIN}
"""


def post_once_a_slot_is_free(url, key, timeout=60.0, **fields):
    """A slot comes back when the shim's handler unwinds, which can be just after the client read
    the end of the answer or left: retry a 429 until the deadline. A leaked slot never comes back,
    so the request stays a 429 and the caller's assert fails."""
    deadline = time.monotonic() + timeout
    while True:
        r = post(url, key, **fields)
        if r.status_code != 429 or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def test_key_options_parse():
    keys = parse_key_lines(KEYS_FILE.splitlines() + ["sk-x : globex  max_concurrent=1", "sk-pad== "])
    assert (keys[URGENT].tenant, keys[URGENT].priority, keys[URGENT].max_concurrent) == ("ops", -5, None)
    assert (keys[LIMITED].priority, keys[LIMITED].max_concurrent) == (3, 2)
    assert keys[PLAIN] == KeyPolicy(default_tenant(PLAIN), 0, None, keys[PLAIN].key_id)
    assert keys["sk-x"].tenant == "globex" and keys["sk-x"].max_concurrent == 1
    assert keys["sk-pad=="].tenant == default_tenant("sk-pad==")       # '=' inside a key is kept
    assert PLAIN not in keys[PLAIN].key_id and keys[PLAIN].key_id != keys[URGENT].key_id
    for bad in ("k:t max_concurent=1", "k:t priority=high", "k:t max_concurrent=0",
                f"k:t priority={2 ** 40}"):
        with pytest.raises(ValueError):
            parse_key_lines([bad])


@pytest.fixture(scope="module")
def fake():
    return FakeLLMClient(delay=0.05)


@pytest.fixture(scope="module")
def url(fake, tmp_path_factory):
    f = tmp_path_factory.mktemp("keys") / "keys.txt"
    f.write_text(KEYS_FILE)
    settings = ShimSettings(model_name="m", api_keys_file=str(f))
    with BackgroundServer(create_app(settings, client=fake)) as srv:
        yield srv.url


def post(url, key, **fields):
    body = {"model": "m", "prompt": "x", "max_tokens": 2, **fields}
    return httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=30)


def test_priority_ceiling(url, fake):
    assert post(url, URGENT).status_code == 200
    assert fake.calls[-1]["params"]["priority"] == -5              # the key's default
    assert fake.calls[-1]["params"]["tenant"] == "ops"
    assert post(url, URGENT, priority=10).status_code == 200       # lowering its own: fine
    assert fake.calls[-1]["params"]["priority"] == 10
    r = post(url, LIMITED, priority=0)                              # more urgent than allowed
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert "at most 3" in r.json()["error"]["message"]
    r = post(url, PLAIN, priority=-1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert post(url, PLAIN).status_code == 200 and "priority" not in fake.calls[-1]["params"]


def test_max_concurrent_is_a_429_and_slots_come_back(url, fake):
    fake.delay = 0.2                                   # ~27 pieces x 0.2 s: long enough to overlap
    try:
        results: list[int] = []
        streams_open = threading.Barrier(3)

        def stream():
            body = {"model": "m", "prompt": "x", "max_tokens": 10, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30,
                              headers={"Authorization": f"Bearer {LIMITED}"}) as r:
                results.append(r.status_code)
                it = r.iter_lines()
                next(it)
                streams_open.wait(timeout=60)
                for _ in it:
                    pass

        threads = [threading.Thread(target=stream) for _ in range(2)]
        for t in threads:
            t.start()
        streams_open.wait(timeout=60)                  # both streams have started
        r = post(url, LIMITED)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert post(url, PLAIN, max_tokens=1).status_code == 200       # other keys unaffected
        for t in threads:
            t.join(timeout=30)
        assert results == [200, 200]
    finally:
        fake.delay = 0.05
    assert post_once_a_slot_is_free(url, LIMITED, max_tokens=1).status_code == 200   # slots released


def test_rejected_and_failed_requests_release_their_slot(url, fake):
    fake.fail_before = InvalidRequestError("bad", param="max_tokens")
    try:
        for stream in (False, True, False):
            assert post(url, LIMITED, stream=stream).status_code == 400
    finally:
        fake.fail_before = None
    for _ in range(3):           # 3 > the limit of 2: each refused request gave its slot back
        assert post_once_a_slot_is_free(url, LIMITED, max_tokens=1).status_code == 200


def test_disconnected_streams_release_their_slot(url, fake):
    rids = []

    async def go():
        async with httpx.AsyncClient(timeout=30) as c:
            for _ in range(4):                        # more than the limit, one after another
                body = {"model": "m", "prompt": "x", "max_tokens": 20, "stream": True}
                # the slot of the stream left before comes back once the shim saw the disconnect
                # (not after a fixed pause): retry a 429 until a deadline; two leaked slots would
                # make every later attempt a 429
                deadline = time.monotonic() + 60
                while True:
                    async with c.stream("POST", url + "/v1/completions", json=body,
                                        headers={"Authorization": f"Bearer {LIMITED}"}) as r:
                        if r.status_code == 429 and time.monotonic() < deadline:
                            await r.aread()
                        else:
                            assert r.status_code == 200
                            rids.append(r.headers["x-request-id"])
                            async for _ in r.aiter_lines():
                                break                  # leave mid-stream
                            break
                    await asyncio.sleep(0.05)
    asyncio.run(go())
    assert post_once_a_slot_is_free(url, LIMITED, max_tokens=1).status_code == 200
    # the slots came back because the shim saw each client leave and aborted it, not because the
    # generations ran to their end
    deadline = time.monotonic() + 60
    while not all(r in fake.aborted or r in fake.finished for r in rids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(rids) == 4 and all(r in fake.aborted and r not in fake.finished for r in rids), rids
