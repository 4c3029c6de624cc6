"""Bad requests get tagged error responses; the next valid request is answered unchanged."""
from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.e2e.helpers import generate, metric, scrape
from tests.e2e.settle import settled

pytestmark = pytest.mark.e2e

VALID = dict(text="你好 🌍 hello", max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def reference(triton_server):
    res = generate(triton_server, "llm", **VALID)
    assert res.error is None and res.finals == 1
    return res


def _still_fine(server, reference):
    res = generate(server, "llm", **VALID)
    assert res.error is None and res.finals == 1
    assert (res.text, res.ids, res.finish_reason) == (reference.text, reference.ids, reference.finish_reason)


@pytest.mark.parametrize("kwargs, tag", [
    (dict(text=""), "[invalid_request param=text_input]"),
    (dict(text="长 " * 1200), "[invalid_request param=text_input]"),
    (dict(text="hi", max_tokens=0), "[invalid_request param=max_tokens]"),
    (dict(text="hi", max_tokens=-5), "[invalid_request param=max_tokens]"),
    (dict(text="hi", max_tokens=10**8), "[invalid_request param=max_tokens]"),
    (dict(text="hi", temperature=float("nan")), "[invalid_request param=temperature]"),
    (dict(text="hi", top_k=-7), "[invalid_request param=top_k]"),
    (dict(text="hi", stop_token_ids="[1, -2]"), "[invalid_request param=stop_token_ids]"),
    (dict(messages='[{"role": "user", "content": "hi"'), "[invalid_request param=messages]"),
    (dict(messages='[{"role": "robot", "content": "hi"}]'), "[invalid_request param=messages]"),
    (dict(messages="[]"), "[invalid_request param=messages]"),
])
def test_ensemble_rejects(triton_server, reference, kwargs, tag):
    res = generate(triton_server, "llm", **kwargs)
    assert res.error is not None and tag in res.error, res
    _still_fine(triton_server, reference)


@pytest.mark.parametrize("kwargs, tag", [
    (dict(input_ids=[]), "[invalid_request param=input_ids]"),
    (dict(input_ids=[1, 2, 10**6]), "[invalid_request param=input_ids]"),
    (dict(), "[invalid_request param=input_ids]"),
    (dict(input_ids=[1, 2], max_tokens=0), "[invalid_request param=max_tokens]"),
    (dict(input_ids=[1, 2], max_tokens=10**8), "[invalid_request param=max_tokens]"),
    (dict(input_ids=[1, 2], temperature="nan"), "[invalid_request param=temperature]"),
    (dict(input_ids=[1, 2], n=0), "[invalid_request param=n]"),
])
def test_engine_rejects(triton_server, reference, kwargs, tag):
    def rejected(snap):
        return metric(snap, "llm_requests_rejected_total", reason="invalid_request")

    # settled: the previous case's rejection is written by the metrics thread off the hot path
    # (a plain scrape could miss it, and this case would then count two); then the exact count
    before = settled(lambda: scrape(triton_server))
    res = generate(triton_server, "engine", **kwargs)
    assert res.error is not None and tag in res.error, res
    after = settled(lambda: scrape(triton_server), ready=lambda s: rejected(s) >= rejected(before) + 1)
    assert rejected(after) == rejected(before) + 1
    _still_fine(triton_server, reference)


@pytest.mark.parametrize("model, name, dtype, data", [
    ("llm", "text_input", "INT32", np.array([7], dtype=np.int32)),
    ("engine", "input_ids", "FP32", np.array([1.0, 2.0], dtype=np.float32)),
    ("engine", "input_ids", "INT64", np.array([1, 2], dtype=np.int64)),
])
def test_wrong_tensor_dtype(triton_server, reference, model, name, dtype, data):
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    inp = grpcclient.InferInput(name, list(data.shape), dtype)
    inp.set_data_from_numpy(data)
    errors = []
    client.start_stream(callback=lambda result, error: errors.append(error))
    client.async_stream_infer(model, [inp], parameters={"max_tokens": 4})
    client.stop_stream()
    assert errors and errors[0] is not None and f"data-type is '{dtype}'" in str(errors[0])
    _still_fine(triton_server, reference)
