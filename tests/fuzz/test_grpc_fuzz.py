"""gRPC fuzz of ``llm`` and ``engine`` (issue 19): hypothesis-made bad requests over tritonclient.

Every generated request carries at least one defect drawn from a list of known-bad values (plus
random noise parameters), so each must be refused with a *tagged* Triton error
(``[invalid_request param=...]``, or ``[queue_full ...]`` / ``[unavailable]``), never
``[internal]``, never a hang, and no process may die. Afterwards a reference request gives the
same output as before and the KV pool is idle again. About 600 requests, well under two minutes.
"""
from __future__ import annotations

import json
import queue
import re
import time
import uuid

import pytest
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.e2e.helpers import generate, make_inputs, metric, scrape

pytestmark = pytest.mark.e2e

TAG = re.compile(r"\[(invalid_request param=[\w.\[\]]+|queue_full retry_after=[\d.]+|unavailable)\]")
EXAMPLES = 300                               # per model
TOTAL = {"count": 0}

INT64 = 2**63
ints = st.one_of(st.integers(-5, 5), st.integers(-INT64, INT64 - 1), st.sampled_from([-1, 0, 2**31, 2**62]))
junk = st.one_of(ints, st.floats(allow_nan=False, allow_infinity=False, width=32), st.booleans(),
                 st.text(max_size=30), st.just("[1, 2"), st.just('{"a": 1}'))
NOISE_KEYS = ["temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
              "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs",
              "min_tokens", "stream", "tenant", "zzz_unknown"]

# One defect each request is sure to carry (parameter name, value).
DEFECTS = st.sampled_from([
    ("max_tokens", 0), ("max_tokens", -7), ("max_tokens", str(2**63)), ("max_tokens", 10**9),
    ("n", 0), ("n", 10**6), ("temperature", -1.0), ("top_p", 1.5), ("top_p", 0.0), ("min_p", 2.0),
    ("top_k", -5), ("presence_penalty", 9.0), ("repetition_penalty", 0.0),
    ("stop_token_ids", "[-1]"), ("stop_token_ids", '["a"]'), ("logprobs", -3), ("top_logprobs", 10**6),
    ("request_priority", 10**12), ("request_timeout", -1.0), ("request_timeout", 10**9),
    ("seed", str(-(2**63) - 1)), ("min_tokens", 10**6), ("tenant", "x" * 400), ("stream", "perhaps"),
    ("ignore_eos", "maybe"), ("max_tokens", "eleven"),
])


def _noise():
    return st.dictionaries(st.sampled_from(NOISE_KEYS), junk, max_size=4)


class Caller:
    """One gRPC stream reused for every fuzz request (sequential: one answer before the next)."""

    def __init__(self, server) -> None:
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.q: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.q.put((result, error)))

    def call(self, model: str, inputs: list, params: dict, timeout: float = 30.0) -> str | None:
        """The error message of the request's answer (None if it was answered without one)."""
        rid = uuid.uuid4().hex
        self.client.async_stream_infer(model, inputs, request_id=rid, parameters=params,
                                       enable_empty_final_response=True)
        deadline = time.monotonic() + timeout
        while True:                               # until an error or the FINAL flag
            result, error = self.q.get(timeout=max(0.1, deadline - time.monotonic()))
            if error is not None:
                return str(error)
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return None

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


@pytest.fixture(scope="module")
def caller(triton_server):
    c = Caller(triton_server)
    yield c
    c.close()


def _reference(server):
    return generate(server, "llm", text="The reference prompt", max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(triton_server):
    ref = _reference(triton_server)
    assert ref.error is None and len(ref.ids) == 12
    return ref


def _check(message: str | None, model: str, params: dict) -> None:
    TOTAL["count"] += 1
    assert message is not None, f"{model} accepted a bad request: {params}"
    assert TAG.search(message), f"{model}: untagged or internal error {message!r} for {params}"


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate],           # no shrinking: bounded time
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(defect=DEFECTS, noise=_noise(), text=st.text(min_size=1, max_size=40),
       as_messages=st.booleans())
def test_llm_refuses_bad_requests_with_tagged_errors(caller, reference, defect, noise, text, as_messages):
    params = {**{k: v for k, v in noise.items() if k != defect[0]}, defect[0]: defect[1]}
    inputs = make_inputs(messages=[{"role": "user", "content": text}]) if as_messages else make_inputs(text=text)
    _check(caller.call("llm", inputs, params), "llm", params)


bad_ids = st.one_of(st.lists(st.integers(-2**31, -1), min_size=1, max_size=5),
                    st.lists(st.integers(10**6, 2**31 - 1), min_size=1, max_size=5))


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate],           # no shrinking: bounded time
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(defect=st.one_of(DEFECTS.map(lambda d: ("param", d)), bad_ids.map(lambda ids: ("ids", ids)),
                        st.just(("ids", None))),
       noise=_noise(), ids=st.lists(st.integers(1, 200), min_size=1, max_size=8))
def test_engine_refuses_bad_requests_with_tagged_errors(caller, reference, defect, noise, ids):
    kind, value = defect
    params = dict(noise)
    if kind == "param":
        params = {**{k: v for k, v in noise.items() if k != value[0]}, value[0]: value[1]}
    else:
        ids = value
        params.setdefault("max_tokens", 4)
    if params.get("stream") not in (None, True, False):
        params["stream"] = "perhaps"
    inputs = [] if ids is None else make_inputs(input_ids=ids)
    _check(caller.call("engine", inputs, params), "engine", params)


def test_after_the_fuzz_the_reference_is_unchanged_and_the_pool_idle(triton_server, reference):
    assert TOTAL["count"] >= 500, TOTAL
    again = _reference(triton_server)
    assert again.error is None and again.ids == reference.ids and again.text == reference.text
    deadline = time.monotonic() + 60          # generous: a loaded CI host is 5-10x slower
    while True:
        snap = scrape(triton_server)
        idle = (metric(snap, "llm_kv_cache_usage_ratio") == 0 and metric(snap, "llm_num_requests_running") == 0
                and metric(snap, "llm_num_requests_waiting") == 0 and metric(snap, "llm_engine_healthy") == 1)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle, {k[0]: v for k, v in snap.items() if "bucket" not in k[0]}
    json.dumps(TOTAL)
