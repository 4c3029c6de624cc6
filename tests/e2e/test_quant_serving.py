"""``triton-llm serve --engine-option quantization=int8`` on the tiny preset: a stream gives the
offline int8 engine's greedy tokens, and a cancelled stream is aborted and frees its KV."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid

import pytest

from backend.serving.launcher import free_port
from tests.conftest import ROOT, model_dir
from tests.e2e.helpers import Result, Stream, abort, make_inputs, metric, scrape, wait_metric

pytestmark = pytest.mark.e2e


class _Addr:
    def __init__(self, grpc: int, metrics: int):
        self.grpc_url = f"127.0.0.1:{grpc}"
        self.metrics_url = f"http://127.0.0.1:{metrics}/metrics"


@pytest.fixture(scope="module")
def int8_server(tmp_path_factory):
    http, grpc, metrics = free_port(), free_port(), free_port()
    cmd = [sys.executable, "-m", "backend.cli", "serve", "--model", str(model_dir("tiny")),
           "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
           "--shim-port", "0", "--workdir", str(tmp_path_factory.mktemp("serve")),
           "--engine-option", "quantization=int8", "--engine-option", "num_kv_blocks=128",
           "--engine-option", "num_threads=1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        deadline = time.monotonic() + 180
        while not any("Ctrl-C to stop" in line for line in lines):
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        yield _Addr(grpc, metrics)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_int8_stream_matches_the_offline_int8_engine(int8_server):
    from backend import LLM, SamplingParams

    ids = [5, 17, 99, 3, 250, 42, 7, 8]
    s = Stream(int8_server)
    res = Result(uuid.uuid4().hex)
    try:
        s.send("engine", make_inputs(input_ids=ids), res.request_id,
               dict(max_tokens=24, temperature=0.0, ignore_eos=True))
        s.collect(res, timeout=120)
    finally:
        s.close()
    assert res.error is None and res.finals == 1 and res.finish_reason == "length"
    assert res.responses > 1                          # streamed, not one final answer
    offline = LLM(str(model_dir("tiny")), quantization="int8", num_kv_blocks=64)
    want = offline.generate([ids], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert res.ids == want[0].outputs[0].token_ids


def test_int8_stream_cancel_frees_the_request(int8_server):
    before, _ = wait_metric(int8_server, lambda m: metric(m, "llm_num_requests_running") == 0, timeout=10.0)
    s = Stream(int8_server)
    res = Result(uuid.uuid4().hex)
    s.send("llm", make_inputs(text="a long story about quantized weights"), res.request_id,
           dict(max_tokens=900, temperature=0.0, ignore_eos=True))
    s.collect(res, until_responses=5, timeout=60)
    assert res.error is None and res.finals == 0
    assert metric(scrape(int8_server), "llm_num_requests_running") == 1
    s.close(cancel=True)
    ctrl = abort(int8_server, res.request_id)
    assert ctrl.error is None and ctrl.finish_reason == "abort"
    wait_metric(int8_server, lambda m: metric(m, "llm_num_requests_running") == 0
                and metric(m, "llm_kv_cache_usage_ratio") == metric(before, "llm_kv_cache_usage_ratio"),
                timeout=5.0)
