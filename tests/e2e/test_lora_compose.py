"""LoRA adapters through tritonserver and the OpenAI shim, composed with the rest of serving:
per-adapter Prometheus metrics (requests, generated tokens, loads and evictions with one slot for
two adapters), structured outputs (a json_schema and a regex request on an adapter equal the
offline engine's greedy constrained output on it) and n=2 (both choices on the adapter)."""
from __future__ import annotations

import json

import openai
import pytest

from backend import LLM, SamplingParams
from backend.structured import StructuredSpec
from tests.conftest import model_dir
from tests.e2e.helpers import metric, scrape
from tests.e2e.settle import settled
from tests.e2e.shim_fixtures import KEY, start_shim, stop_shim
from tests.unit.lora_helpers import make_adapter

pytestmark = pytest.mark.e2e
pytest.importorskip("xgrammar")

PROMPT = "Once upon a time"
MAX_TOKENS = 12
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
REGEX = r"[a-z]{3,8}-[0-9]{2}"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root, tiny = tmp_path_factory.mktemp("loras"), model_dir("tiny")
    return {"a": str(make_adapter(tiny, root / "a", 8, 16, ["q_proj", "v_proj"], 51)),
            "b": str(make_adapter(tiny, root / "b", 16, 32, ["o_proj", "up_proj"], 52))}


@pytest.fixture(scope="module")
def offline(adapters):
    """The offline engine's greedy outputs per (adapter, constraint)."""
    llm = LLM(str(model_dir("tiny")), num_kv_blocks=64, max_loras=2, max_lora_rank=16, lora_modules=adapters)
    specs = {"plain": (None, MAX_TOKENS), "json": (StructuredSpec.json(SCHEMA), 64),
             "regex": (StructuredSpec.regex(REGEX), 32)}
    out = {}
    for lora in ("a", "b", None):
        for kind, (spec, max_tokens) in specs.items():
            sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=spec is None, structured=spec,
                                lora=lora)
            out[lora, kind] = llm.generate([PROMPT], sp)[0].outputs[0].text
    return out


@pytest.fixture(scope="module")
def served(adapters, tmp_path_factory):
    """tritonserver with ONE adapter slot for two adapters (every switch loads one, evicts the
    other), and the shim naming both."""
    from backend.serving.launcher import TritonServer

    opts = {"num_kv_blocks": "64", "block_size": "16", "num_threads": "1", "max_loras": "1",
            "max_lora_rank": "16", "lora_modules": json.dumps(adapters)}
    with TritonServer(model_dir("tiny"), engine_options=opts, quiet=True) as server:
        shim = start_shim(server, tmp_path_factory.mktemp("shim"), extra_args=["--lora-name", "a", "--lora-name", "b"])
        try:
            yield server, shim
        finally:
            stop_shim(shim.proc)


def sdk(shim) -> openai.OpenAI:
    return openai.OpenAI(base_url=shim.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def complete(shim, model: str, **kw):
    extra = kw.pop("extra_body", {"ignore_eos": True})
    return sdk(shim).completions.create(model=model, prompt=PROMPT, temperature=0,
                                        **{"max_tokens": MAX_TOKENS, **kw}, extra_body=extra)


def test_per_adapter_metrics(served, offline):
    server, shim = served
    assert complete(shim, "b").choices[0].text == offline["b", "plain"]      # b resident, a evicted
    idle = lambda s: metric(s, "llm_num_requests_running") == 0 and metric(s, "llm_num_requests_waiting") == 0  # noqa: E731
    before = settled(lambda: scrape(server), ready=lambda s: idle(s) and metric(s, "llm_lora_requests_total", lora="b") >= 1)
    for name in ("a", "b", "a"):                   # each switch: load one, evict the other
        assert complete(shim, name).choices[0].text == offline[name, "plain"]
    assert complete(shim, "tiny").choices[0].text == offline[None, "plain"]

    def d(snap, name, lora):
        return metric(snap, name, lora=lora) - metric(before, name, lora=lora)

    after = settled(lambda: scrape(server), ready=lambda s: d(s, "llm_lora_generation_tokens_total", "a") >= 2 * MAX_TOKENS
                    and d(s, "llm_lora_generation_tokens_total", "b") >= MAX_TOKENS and d(s, "llm_lora_loads_total", "a") >= 2)
    assert (d(after, "llm_lora_requests_total", "a"), d(after, "llm_lora_requests_total", "b")) == (2, 1)
    assert d(after, "llm_lora_generation_tokens_total", "a") == 2 * MAX_TOKENS
    assert d(after, "llm_lora_generation_tokens_total", "b") == MAX_TOKENS
    assert (d(after, "llm_lora_loads_total", "a"), d(after, "llm_lora_evictions_total", "a")) == (2, 1)
    assert (d(after, "llm_lora_loads_total", "b"), d(after, "llm_lora_evictions_total", "b")) == (1, 2)
    # the base model's request is in the engine's totals, on no adapter's series
    assert {labels for name, labels in after if name == "llm_lora_requests_total"} == {(("lora", "a"),), (("lora", "b"),)}


def test_structured_output_on_an_adapter(served, offline):
    _, shim = served
    r = complete(shim, "a", max_tokens=64, extra_body={"guided_json": SCHEMA})
    text = r.choices[0].text
    assert r.choices[0].finish_reason == "stop" and text == offline["a", "json"]
    value = json.loads(text)
    assert set(value) == {"name", "n"} and isinstance(value["n"], int) and len(value["name"]) <= 8
    r = complete(shim, "b", max_tokens=32, extra_body={"guided_regex": REGEX})
    assert r.choices[0].text == offline["b", "regex"]
    import re
    assert re.fullmatch(REGEX, r.choices[0].text)
    # the adapters steer the constrained choice: the same constraint on the base answers otherwise
    assert offline["a", "json"] != offline[None, "json"] or offline["b", "regex"] != offline[None, "regex"]


def test_n2_on_an_adapter(served, offline):
    _, shim = served
    r = complete(shim, "b", n=2)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert [c.text for c in r.choices] == [offline["b", "plain"]] * 2
    assert offline["b", "plain"] != offline[None, "plain"]
    r = complete(shim, "a", n=2, max_tokens=32, extra_body={"guided_regex": REGEX})
    assert [c.text for c in r.choices] == [offline["a", "regex"]] * 2
