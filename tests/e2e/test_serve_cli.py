"""``triton-llm serve``: endpoints printed when ready; SIGTERM drains open streams, leaves nothing."""
from __future__ import annotations

import signal
import uuid

import pytest

from backend.serving.launcher import free_port
from tests.conftest import model_dir
from tests.e2e.helpers import Result, Stream, make_inputs, reap_serve, start_serve

pytestmark = pytest.mark.e2e


class _Addr:
    def __init__(self, grpc_port: int):
        self.grpc_url = f"127.0.0.1:{grpc_port}"


def test_serve_prints_endpoints_and_drains_on_sigterm(tmp_path):
    http, grpc, metrics = free_port(), free_port(), free_port()
    workdir = tmp_path / "serve"
    proc, lines = start_serve(["--model", str(model_dir("tiny")), "--http-port", str(http), "--grpc-port", str(grpc),
                               "--metrics-port", str(metrics), "--shim-port", "0", "--workdir", str(workdir),
                               "--engine-option", "num_kv_blocks=128", "--engine-option", "num_threads=1"],
                              timeout=120)
    try:
        out = "".join(lines)
        assert f"grpc 127.0.0.1:{grpc}" in out and f"http://127.0.0.1:{metrics}/metrics" in out

        s = Stream(_Addr(grpc))
        res = Result(uuid.uuid4().hex)
        s.send("llm", make_inputs(text="drain me"), res.request_id,
               dict(max_tokens=200, temperature=0.0, ignore_eos=True))
        s.collect(res, until_responses=2, timeout=60)
        proc.send_signal(signal.SIGTERM)
        s.collect(res, timeout=60)                  # the open stream runs to its end
        s.close()
        assert res.error is None and res.finals == 1
        assert res.finish_reason == "length" and len(res.ids) == 200
        # no wall-clock bound (a loaded CI host is 5-10x slower); a drain that hangs times out
        assert proc.wait(timeout=120) == 0
    finally:
        reap_serve(proc, workdir)


def test_serve_disagg_serves_a_stream_and_drains_it_on_sigterm(tmp_path):
    """``serve --disagg``: the prefill/decode pair and the shim; a stream opened before SIGTERM
    (handed over, so on the decode server) runs to its end, then everything stops with exit 0."""
    import json
    import urllib.request

    grpc, shim_port = free_port(), free_port()
    workdir = tmp_path / "serve-disagg"
    proc, lines = start_serve(["--disagg", "--model", str(model_dir("tiny")), "--http-port", str(free_port()),
                               "--grpc-port", str(grpc), "--metrics-port", str(free_port()),
                               "--shim-port", str(shim_port), "--workdir", str(workdir),
                               "--engine-option", "num_kv_blocks=128", "--engine-option", "num_threads=1"])
    try:
        out = "".join(lines)
        assert "prefill  tritonserver" in out and "decode   tritonserver" in out
        assert f"http://127.0.0.1:{shim_port}/v1" in out

        body = {"model": "tiny", "messages": [{"role": "user", "content": "drain me"}], "max_tokens": 120,
                "temperature": 0, "ignore_eos": True, "stream": True}
        req = urllib.request.Request(f"http://127.0.0.1:{shim_port}/v1/chat/completions",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        resp = urllib.request.urlopen(req, timeout=60)
        events = []
        while len(events) < 3:                      # streaming: past the hand-over
            line = resp.readline()
            assert line, events
            if line.startswith(b"data: {"):
                events.append(json.loads(line[6:]))
        proc.send_signal(signal.SIGTERM)
        for line in resp:                           # the open stream runs to its end
            if line.startswith(b"data: {"):
                events.append(json.loads(line[6:]))
        assert not any("error" in e for e in events), events[-1]
        finish = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
        assert finish == ["length"]
        # no wall-clock bound (a loaded CI host is 5-10x slower); a drain that hangs times out
        assert proc.wait(timeout=120) == 0
    finally:
        reap_serve(proc, workdir)
