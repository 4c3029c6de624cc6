"""The model.py adapters under a fake triton_python_backend_utils, on the tiny checkpoint.

Covers what the e2e suite cannot reach cheaply: an engine crash (in-flight requests get an error
with FINAL, new ones ``[unavailable]``, the health gauge drops to 0) and the metric wiring.
"""
from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
import types

import numpy as np
import pytest

from backend.serving.repository import TEMPLATES, generate_repository
from tests.conftest import model_dir

FINAL = 1


class Tensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class TritonError(Exception):
    INVALID_ARG, UNAVAILABLE, INTERNAL = "INVALID_ARG", "UNAVAILABLE", "INTERNAL"

    def __init__(self, msg, code="INTERNAL"):
        super().__init__(msg)
        self.msg, self.code = msg, code


class InferenceResponse:
    def __init__(self, output_tensors=(), error=None):
        self.outputs = {t.name(): t.as_numpy() for t in output_tensors}
        self.error = error


class Metric:
    def __init__(self, labels, buckets=None):
        self.labels, self.value, self.observed = labels, 0.0, []

    def increment(self, v):
        self.value += v

    def set(self, v):
        self.value = v

    def observe(self, v):
        self.observed.append(v)


class MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    all: dict = {}

    def __init__(self, name, description, kind):
        self.name, self.kind, self.metrics = name, kind, []
        MetricFamily.all[name] = self

    def Metric(self, labels, buckets=None):   # noqa: N802 - pb_utils' spelling
        m = Metric(labels, buckets)
        self.metrics.append(m)
        return m


class Sender:
    def __init__(self):
        self.responses, self.cancelled = [], False
        self.done = threading.Event()

    def send(self, response=None, flags=0):
        self.responses.append((response, flags))
        if flags & FINAL:
            self.done.set()

    def is_cancelled(self):
        return self.cancelled


class Request:
    def __init__(self, rid, inputs, params):
        self.inputs, self.params, self.rid, self.sender = inputs, params, rid, Sender()

    def request_id(self):
        return self.rid

    def parameters(self):
        return json.dumps(self.params)

    def get_response_sender(self):
        return self.sender

    def timeout(self):
        return 0


class Logger:
    """pb_utils.Logger: what the model sent to tritonserver's log."""
    lines: list[tuple[str, str]] = []

    @classmethod
    def log_info(cls, msg):
        cls.lines.append(("info", msg))

    @classmethod
    def log_warn(cls, msg):
        cls.lines.append(("warn", msg))


def get_input_tensor_by_name(request, name):
    v = request.inputs.get(name)
    return None if v is None else Tensor(name, v)


@pytest.fixture(scope="module")
def pb(tmp_path_factory):
    fake = types.ModuleType("triton_python_backend_utils")
    fake.Tensor, fake.TritonError, fake.InferenceResponse, fake.MetricFamily = Tensor, TritonError, InferenceResponse, MetricFamily
    fake.Logger = Logger
    fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    fake.get_input_tensor_by_name = get_input_tensor_by_name
    fake.using_decoupled_model_transaction_policy = lambda cfg: cfg.get("model_transaction_policy", {}).get("decoupled")
    old = sys.modules.get("triton_python_backend_utils")
    sys.modules["triton_python_backend_utils"] = fake
    repo = generate_repository(tmp_path_factory.mktemp("repo") / "r", model_dir("tiny"),
                               engine_options={"num_kv_blocks": "64", "num_threads": "1"})
    yield repo
    if old is None:
        del sys.modules["triton_python_backend_utils"]
    else:
        sys.modules["triton_python_backend_utils"] = old


def load(repo, name, config: dict):
    spec = importlib.util.spec_from_file_location(f"tllm_test_{name}", TEMPLATES / name / "1" / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = mod.TritonPythonModel()
    params = {}
    text = (repo / name / "config.pbtxt").read_text()
    from backend.serving.repository import declared_parameters
    params = {k: {"string_value": v} for k, v in declared_parameters(text).items()}
    model.initialize({"model_config": json.dumps({**config, "parameters": params}),
                      "model_name": name, "model_version": "1"})
    return model


def test_preprocessing_and_postprocessing_adapters(pb):
    pre = load(pb, "preprocessing", {})
    msgs = json.dumps([{"role": "user", "content": "你好 😀"}])
    ok, bad = pre.execute([Request("a", {"messages": np.array([msgs.encode()], dtype=object)}, {}),
                           Request("b", {"text_input": np.array([b""], dtype=object)}, {})])
    ids = ok.outputs["input_ids"]
    assert ids.dtype == np.int32 and ids.size > 0 and ok.error is None
    assert bad.error.code == "INVALID_ARG" and bad.error.msg.startswith("[invalid_request param=text_input]")

    post = load(pb, "postprocessing", {})
    window = pre.pre.tokenizer.encode("你好 😀")
    inputs = {"window_ids": np.array(window, np.int32), "num_sent": np.array([0], np.int32),
              "max_chars": np.array([-1], np.int32), "finish_reason": np.array([b"length"], dtype=object),
              "output_ids": np.array(window, np.int32), "index": np.array([0], np.int32),
              "prompt_tokens": np.array([3], np.int32), "completion_tokens": np.array([len(window)], np.int32),
              "cached_tokens": np.array([0], np.int32),
              "logprobs": np.array([json.dumps([{"id": window[0], "logprob": -0.5, "top": [[window[0], -0.5]]}]).encode()],
                                   dtype=object),
              "metrics": np.array([b""], dtype=object)}
    (resp,) = post.execute([Request("a", inputs, {})])
    assert resp.error is None
    assert resp.outputs["text_output"][0].decode() == "你好 😀"
    lp = json.loads(resp.outputs["logprobs"][0])
    assert lp[0]["logprob"] == -0.5 and lp[0]["top_logprobs"][0]["bytes"] == lp[0]["bytes"]


def test_preprocessing_validates_against_the_engines_context_window(pb, tmp_path):
    """The pool (8 blocks of 16 tokens) bounds the window to 128, below the checkpoint's 1024: a
    prompt the engine could never hold is rejected by preprocessing, naming the prompt."""
    repo = generate_repository(tmp_path / "r", model_dir("tiny"), models=["preprocessing"],
                               engine_options={"num_kv_blocks": "8"})
    pre = load(repo, "preprocessing", {})
    assert pre.pre.context_window == 128
    fits, too_long = pre.execute([Request("a", {"text_input": np.array([b"hi " * 20], dtype=object)}, {}),
                                  Request("b", {"text_input": np.array([b"hi " * 200], dtype=object)}, {})])
    assert fits.error is None
    assert too_long.error.code == "INVALID_ARG"
    assert too_long.error.msg.startswith("[invalid_request param=text_input] the prompt has")
    assert "context window is 128 tokens" in too_long.error.msg


def test_engine_adapter_streams_then_survives_a_crash(pb):
    engine = load(pb, "engine", {"model_transaction_policy": {"decoupled": True}})
    svc = engine.service
    try:
        # the startup line (dtype, quantization, weight bytes) goes to tritonserver's log
        assert any(level == "info" and "quantization none" in msg and "MiB" in msg for level, msg in Logger.lines)
        req = Request("r1", {"input_ids": np.array([5, 6, 7], np.int32)}, {"max_tokens": 4, "temperature": 0})
        assert engine.execute([req]) is None
        assert req.sender.done.wait(30)
        flags = [f for _, f in req.sender.responses]
        assert flags.count(FINAL) == 1 and flags[-1] == FINAL
        assert req.sender.responses[-1][0].outputs["finish_reason"][0] == b"length"

        def broken(batch):
            raise RuntimeError("device fell off the bus")

        svc.loop.engine.runner.execute = broken
        crash = Request("r2", {"input_ids": np.array([5, 6, 7], np.int32)}, {"max_tokens": 4})
        engine.execute([crash])
        assert crash.sender.done.wait(30)
        (resp, flag), = crash.sender.responses
        assert flag == FINAL and resp.error.code == "INTERNAL" and "device fell off the bus" in resp.error.msg
        later = Request("r3", {"input_ids": np.array([5], np.int32)}, {})
        engine.execute([later])
        assert later.sender.done.wait(30)
        (resp, flag), = later.sender.responses
        assert resp.error.code == "UNAVAILABLE" and resp.error.msg.startswith("[unavailable]")
        healthy = MetricFamily.all["llm_engine_healthy"].metrics[0]
        errors = MetricFamily.all["llm_requests_finished_total"].metrics[3]
        # the response thread queues the crash's metric events around its sends: flush until they
        # are applied (a deadline, not one flush that might come before they were queued)
        deadline = time.monotonic() + 30
        while True:
            svc.metrics.flush()
            if (healthy.value == 0.0 and errors.value >= 1) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert healthy.value == 0.0
        assert errors.labels["reason"] == "error"
        assert errors.value == 1
    finally:
        engine.finalize()
