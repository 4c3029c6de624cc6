"""``triton-llm serve --engine-option quantization=int8`` on the tiny preset: a stream gives the
offline int8 engine's greedy tokens, a cancelled stream is aborted and frees its KV, and the OpenAI
SDK's ``models.list()`` (shim -> Triton's engine config) and the startup log report int8 with the
loaded model's weight bytes."""
from __future__ import annotations

import re
import subprocess
import uuid

import pytest

from backend.serving.launcher import free_port
from tests.conftest import model_dir
from tests.e2e.helpers import Result, Stream, abort, make_inputs, metric, scrape, start_serve, wait_metric
from tests.e2e.settle import settled

pytestmark = pytest.mark.e2e


class _Addr:
    def __init__(self, grpc: int, metrics: int, shim: int, workdir, lines: list[str]):
        self.grpc_url = f"127.0.0.1:{grpc}"
        self.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
        self.shim_url = f"http://127.0.0.1:{shim}/v1"
        self.workdir, self.lines = workdir, lines


@pytest.fixture(scope="module")
def int8_server(tmp_path_factory):
    http, grpc, metrics, shim = free_port(), free_port(), free_port(), free_port()
    workdir = tmp_path_factory.mktemp("serve")
    # A short drain: the teardown need not wait the default 60 s for the cancelled stream's leftovers.
    proc, lines = start_serve(["--model", str(model_dir("tiny")), "--http-port", str(http), "--grpc-port", str(grpc),
                               "--metrics-port", str(metrics), "--shim-port", str(shim), "--workdir", str(workdir),
                               "--engine-option", "quantization=int8", "--engine-option", "num_kv_blocks=128",
                               "--engine-option", "num_threads=1"], env={"TRITON_LLM_DRAIN_SECONDS": "2"})
    try:
        yield _Addr(grpc, metrics, shim, workdir, lines)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
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
    before = settled(lambda: scrape(int8_server), ready=lambda m: metric(m, "llm_num_requests_running") == 0)
    s = Stream(int8_server)
    res = Result(uuid.uuid4().hex)
    s.send("llm", make_inputs(text="a long story about quantized weights"), res.request_id,
           dict(max_tokens=900, temperature=0.0, ignore_eos=True))
    s.collect(res, until_responses=5, timeout=60)
    assert res.error is None and res.finals == 0
    # the gauge is written by the metrics thread after a batch: wait for it, do not sample it once
    wait_metric(int8_server, lambda m: metric(m, "llm_num_requests_running") == 1, timeout=60.0)
    s.close(cancel=True)
    ctrl = abort(int8_server, res.request_id)
    assert ctrl.error is None and ctrl.finish_reason == "abort"
    # freed and counted as aborted (no wall-clock bound: a loaded CI host is 5-10x slower; a cancel
    # that did not reach the engine lets the request end by length, never counted as aborted)
    wait_metric(int8_server, lambda m: metric(m, "llm_num_requests_running") == 0
                and metric(m, "llm_kv_cache_usage_ratio") == metric(before, "llm_kv_cache_usage_ratio")
                and metric(m, "llm_requests_aborted_total") >= metric(before, "llm_requests_aborted_total") + 1,
                timeout=60.0)


def test_models_card_and_startup_log_report_int8(int8_server):
    """The card's dtype / quantization / weight_bytes are the loaded int8 model's (offline engine),
    and the engine's startup log line says the same."""
    import openai

    from backend import LLM

    sdk = openai.OpenAI(base_url=int8_server.shim_url, api_key="none", max_retries=0, timeout=30)
    card = sdk.models.list().data[0]
    offline = LLM(str(model_dir("tiny")), quantization="int8", num_kv_blocks=64)
    q = offline.engine.runner.model.quantization
    assert q["method"] == "int8"
    assert (card.dtype, card.quantization, card.quant_group_size, card.weight_bytes) == \
        ("float32", "int8", q["group_size"], q["weight_bytes"])
    assert card.weight_bytes < 0.5 * LLM(str(model_dir("tiny")), num_kv_blocks=64) \
        .engine.runner.model.quantization["weight_bytes"]
    assert sdk.models.retrieve(card.id).weight_bytes == card.weight_bytes
    log = (int8_server.workdir / "tritonserver.log").read_text(errors="replace") + "".join(int8_server.lines)
    m = re.search(r"loaded \S+: dtype (\w+), quantization (\w+).*?, weights ([\d.]+) MiB", log)
    assert m, log[-3000:]
    assert m.groups() == ("float32", "int8", f"{q['weight_bytes'] / 2**20:.1f}")
