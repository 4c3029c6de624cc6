"""Issue 31's "Exact" through the full stack: tritonserver with three seeded adapters (ranks 8, 16,
64) registered at start (engine options max_loras / lora_modules); requests on each of them and on
the base model, all in flight together through the ``llm`` ensemble (request parameter ``lora``),
give transformers + PEFT's greedy fp32 tokens. The ``engine`` model called directly takes the
parameter too, and an unknown adapter is a clear error."""
from __future__ import annotations

import json
import uuid

import pytest

from tests.conftest import model_dir
from tests.e2e.helpers import Result, Stream, generate, make_inputs
from tests.unit.lora_helpers import make_adapters, peft_greedy

pytestmark = pytest.mark.e2e

PROMPTS = ["Hello, world! Tell me a story.", "What is the capital of France?", "def add(a, b):",
           "Once upon a time", "Write a haiku about Triton.", "1 2 3 4 5 6 7", "the cat sat on the mat.",
           "Translate to German: good morning"]
ROUTE = ["ada8", None, "ada16", "ada64", "ada8", "ada64", None, "ada16"]
MAX_NEW = 12
GREEDY = {"max_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return {k: str(v) for k, v in make_adapters(model_dir("tiny"), tmp_path_factory.mktemp("loras")).items()}


@pytest.fixture(scope="module")
def prompt_ids():
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(model_dir("tiny")))
    return [tok(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(adapters, prompt_ids):
    """PEFT's tokens for each request's (adapter, prompt)."""
    want = [None] * len(PROMPTS)
    for route in set(ROUTE):
        idx = [i for i, r in enumerate(ROUTE) if r == route]
        got = peft_greedy(model_dir("tiny"), adapters[route] if route else None, [prompt_ids[i] for i in idx], MAX_NEW)
        for i, g in zip(idx, got):
            want[i] = g
    base = peft_greedy(model_dir("tiny"), None, prompt_ids, MAX_NEW)
    for route in set(ROUTE) - {None}:           # each adapter changes its answers: not a no-op
        assert any(want[i] != base[i] for i, r in enumerate(ROUTE) if r == route), route
    return want


@pytest.fixture(scope="module")
def lora_server(adapters):
    from backend.serving.launcher import TritonServer

    opts = {"num_kv_blocks": "128", "block_size": "16", "num_threads": "1", "max_loras": "3",
            "max_lora_rank": "64", "lora_modules": json.dumps(adapters)}
    with TritonServer(model_dir("tiny"), engine_options=opts, quiet=True) as server:
        yield server


def _params(route: str | None) -> dict:
    return {**GREEDY, **({"lora": route} if route else {})}


def test_ensemble_mixed_adapters_equal_peft(lora_server, expected):
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
    for i, (res, want) in enumerate(zip(results, expected)):
        assert res.error is None and res.finals == 1, (i, res)
        assert res.ids == want, (i, ROUTE[i])


def test_engine_model_and_unknown_adapter(lora_server, expected, prompt_ids):
    res = generate(lora_server, "engine", input_ids=prompt_ids[3], **_params("ada64"))
    assert res.error is None and res.ids == expected[3]
    bad = generate(lora_server, "llm", text=PROMPTS[0], **_params("nope"))
    assert bad.error is not None and "unknown LoRA adapter 'nope'" in bad.error
    assert generate(lora_server, "llm", text=PROMPTS[1], **_params(None)).ids == expected[1]
