"""Issue 19 through Triton directly: duplicate ids, tenant-scoped aborts, bounded inputs; issue 30:
the admin key off the command line."""
from __future__ import annotations

import json
import pathlib
import urllib.error
import urllib.request
import uuid

import pytest

from backend.serving.argv_secret import MARK
from backend.serving.tritonserver import ADMIN_HEADER
from tests.e2e.helpers import Result, Stream, generate, make_inputs

pytestmark = pytest.mark.e2e


# Long enough that the request is still running when the test's next request arrives, even on a
# loaded host (150 tokens took ~0.25 s: a slow second request could find it finished). The tiny
# model's window is 1024 positions.
LONG = 900


def _open_long(server, rid, **params):
    s = Stream(server)
    res = Result(rid)
    s.send("engine", make_inputs(input_ids=[5, 6, 7, 8]), rid,
           dict(max_tokens=LONG, temperature=0.0, ignore_eos=True, **params))
    s.collect(res, until_responses=1, timeout=60)
    return s, res


def test_duplicate_request_id_is_rejected_and_the_first_runs_on(triton_server):
    rid = f"dup-{uuid.uuid4().hex}"
    s, first = _open_long(triton_server, rid)
    try:
        second = generate(triton_server, "engine", input_ids=[1, 2, 3], request_id=rid, max_tokens=4)
        assert second.error is not None and "[invalid_request param=request_id]" in second.error
        s.collect(first, timeout=60)
        assert first.error is None and first.finals == 1
        assert first.finish_reason == "length" and len(first.ids) == LONG    # not overwritten
    finally:
        s.close()


def test_abort_only_stops_a_request_of_the_same_tenant(triton_server):
    rid = f"ten-{uuid.uuid4().hex}"
    s, res = _open_long(triton_server, rid, tenant="alice")
    try:
        other = generate(triton_server, "engine", request_id=f"abort-{rid}-m", abort_request_id=rid,
                         tenant="mallory")
        assert other.error is None and other.finish_reason == ""            # nothing of mallory's open
        own = generate(triton_server, "engine", request_id=f"abort-{rid}-a", abort_request_id=rid,
                       tenant="alice")
        assert own.finish_reason == "abort"
        s.collect(res, timeout=30)
        assert res.finish_reason == "abort" and len(res.ids) < LONG
    finally:
        s.close()


@pytest.mark.parametrize("model,inputs,params,param", [
    ("engine", dict(input_ids=[1] * 100_000), dict(max_tokens=4), "input_ids"),
    ("llm", dict(text="x" * 200_000), dict(max_tokens=4), "text_input"),
    ("llm", dict(messages=[{"role": "user", "content": "y" * 200_000}]), {}, "messages"),
    ("llm", dict(text="hi"), dict(max_tokens=str(2**63)), "max_tokens"),
    ("llm", dict(text="hi"), dict(seed=str(-(2**63) - 1)), "seed"),
    ("engine", dict(input_ids=[1, 2]), dict(request_priority=10**9), "request_priority"),
    ("engine", dict(input_ids=[1, 2]), dict(tenant="t" * 300), "tenant"),
])
def test_oversized_and_out_of_range_inputs_are_tagged_quickly(triton_server, model, inputs, params, param):
    # no wall-clock bound (a loaded CI host is 5-10x slower); a server that processes the input
    # instead of refusing it answers without the tag, one that hangs times out
    res = generate(triton_server, model, **inputs, **params, timeout=60)
    assert res.error is not None and f"[invalid_request param={param}]" in res.error, res.error


def test_the_admin_key_is_not_on_tritonservers_command_line(triton_server):
    """Issue 30: /proc/<pid>/cmdline is readable by every local user; the repository API's admin
    key reaches tritonserver through a file its preloaded loader read and deleted at start."""
    key = triton_server._admin_key
    cmdline = pathlib.Path(f"/proc/{triton_server.proc.pid}/cmdline").read_bytes().decode().split("\0")
    restricted = [a for a in cmdline if a.startswith(("--http-restricted-api=", "--grpc-restricted-protocol="))]
    assert len(restricted) == 2 and all(MARK in a for a in restricted), restricted
    assert key not in "\0".join(cmdline)
    assert not any(pathlib.Path(a.split(MARK, 1)[1]).exists() for a in restricted)    # read and deleted

    def index(headers: dict) -> int:
        req = urllib.request.Request(f"http://{triton_server.http_url}/v2/repository/index", method="POST",
                                     data=b"{}", headers={"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                assert {m["name"] for m in json.loads(r.read())} >= {"llm", "engine"}
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    assert index({ADMIN_HEADER: key}) == 200                       # the key the server got is the real one
    assert index({}) in (401, 403) and index({ADMIN_HEADER: "@" + key[1:]}) in (401, 403)
