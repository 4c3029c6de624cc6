"""The ``lora`` request parameter through the full stack: tritonserver with adapters registered
at start (engine options max_loras / lora_modules), the ``llm`` ensemble and the ``engine`` model
called directly, mixed with base-model requests in flight together; greedy answers equal the
offline engine's on the same adapters, and an unknown adapter is a clear error."""
from __future__ import annotations

import json
import uuid

import pytest

from backend import LLM, SamplingParams
from tests.conftest import model_dir
from tests.e2e.helpers import Result, Stream, generate, make_inputs
from tests.unit.lora_helpers import make_adapter

pytestmark = pytest.mark.e2e

PROMPTS = ["Hello, world! Tell me a story.", "What is the capital of France?", "def add(a, b):",
           "Once upon a time"]
ROUTE = ["a", None, "b", "a"]
GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    tiny = model_dir("tiny")
    return {"a": str(make_adapter(tiny, root / "a", 8, 16, ["q_proj", "v_proj", "down_proj"], 31)),
            "b": str(make_adapter(tiny, root / "b", 16, 16, ["k_proj", "o_proj", "gate_proj"], 32))}


@pytest.fixture(scope="module")
def expected(adapters):
    llm = LLM(str(model_dir("tiny")), num_kv_blocks=64, max_loras=2, lora_modules=adapters)
    outs = llm.generate(PROMPTS, [SamplingParams(lora=r, **GREEDY) for r in ROUTE])
    return [(o.outputs[0].text, o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def lora_server(adapters):
    from backend.serving.launcher import TritonServer

    opts = {"num_kv_blocks": "64", "block_size": "16", "num_threads": "1", "max_loras": "2",
            "lora_modules": json.dumps(adapters)}
    with TritonServer(model_dir("tiny"), engine_options=opts, quiet=True) as server:
        yield server


def _params(route: str | None) -> dict:
    return {**GREEDY, **({"lora": route} if route else {})}


def test_ensemble_mixed_adapters_equal_offline(lora_server, expected):
    streams = [Stream(lora_server) for _ in PROMPTS]
    results = [Result(uuid.uuid4().hex) for _ in PROMPTS]
    try:
        for s, res, prompt, route in zip(streams, results, PROMPTS, ROUTE):   # all in flight at once
            s.send("llm", make_inputs(text=prompt), res.request_id, _params(route))
        for s, res in zip(streams, results):
            s.collect(res, timeout=300)
    finally:
        for s in streams:
            s.close()
    for res, (text, ids) in zip(results, expected):
        assert res.error is None and res.finals == 1, res
        assert (res.text, res.ids) == (text, ids)


def test_engine_model_and_unknown_adapter(lora_server, expected):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(model_dir("tiny")))
    ids = tok(PROMPTS[2])["input_ids"]
    res = generate(lora_server, "engine", input_ids=ids, **_params("b"))
    assert res.error is None and res.ids == expected[2][1]
    bad = generate(lora_server, "llm", text=PROMPTS[0], **_params("nope"))
    assert bad.error is not None and "unknown LoRA adapter 'nope'" in bad.error
    assert generate(lora_server, "llm", text=PROMPTS[1], **_params(None)).ids == expected[1][1]
