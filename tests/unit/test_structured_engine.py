"""Grammar-constrained decoding through the whole engine on the ``tiny`` preset. Its weights are
random, so it cannot write JSON by chance: every output that parses and validates is the
grammar's doing. Also: ``max_tokens`` inside a value ends with "length", unconstrained neighbours
are unchanged, n > 1, preemption, speculative decoding, abort, tool calls."""
from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from backend import LLM, SamplingParams
from backend.structured import StructuredSpec
from tests.conftest import model_dir

pytest.importorskip("xgrammar")


class Address(BaseModel):
    street: str = Field(max_length=16)
    zip: int = Field(ge=0, le=99999)


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=150)
    verified: bool
    address: Address
    tags: list[Literal["a", "b", "c"]] = Field(max_length=3)


class Item(BaseModel):
    sku: str = Field(max_length=8)
    price: float = Field(ge=0, le=1000)
    qty: int = Field(ge=1, le=10)


class Order(BaseModel):
    id: int = Field(ge=0, le=10**6)
    status: Literal["new", "paid", "shipped"]
    items: list[Item] = Field(min_length=1, max_length=3)
    gift: bool


class Attendee(BaseModel):
    name: str = Field(max_length=8)
    vip: bool


class Event(BaseModel):
    kind: Literal["talk", "workshop"]
    year: int = Field(ge=2000, le=2100)
    attendees: list[Attendee] = Field(max_length=2)
    score: float = Field(ge=-1, le=1)
    summary: str = Field(max_length=20)


MODELS = [Person, Order, Event]
PER_SCHEMA = 50
MAX_TOKENS = 400
PROMPT = [5, 17, 99, 4, 23]


@pytest.fixture(scope="module")
def llm():
    return LLM(model_dir("tiny"), num_kv_blocks=1024, max_num_seqs=64)


def _json(model, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(structured=StructuredSpec.json(model.model_json_schema()), **kw)


def test_every_output_parses_and_validates(llm):
    params = [_json(m, temperature=1.0, seed=s) for m in MODELS for s in range(PER_SCHEMA)]
    outs = llm.generate([PROMPT] * len(params), params)
    for k, out in enumerate(outs):
        model, c = MODELS[k // PER_SCHEMA], out.outputs[0]
        assert c.finish_reason == "stop", (k, c.text)
        model.model_validate_json(c.text, strict=True)
    texts = {o.outputs[0].text for o in outs}
    assert len(texts) > 0.9 * len(outs)            # seeded samples, not one answer repeated


def test_greedy_and_length_inside_a_value(llm):
    out = llm.generate([PROMPT], _json(Person, temperature=0))[0].outputs[0]
    Person.model_validate_json(out.text)
    short = llm.generate([PROMPT], _json(Person, temperature=0, max_tokens=4))[0].outputs[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 4
    with pytest.raises(ValueError):
        json.loads(short.text)                   # cut off, and says so: never "stop"


def test_unconstrained_neighbours_are_unchanged(llm):
    free = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)]
    prompts = [[3, 4, 5, 6], [9, 8, 7]]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free)]
    mixed = llm.generate(prompts + [PROMPT] * 4, free + [_json(m, temperature=1.0, seed=1) for m in MODELS]
                         + [SamplingParams(max_tokens=8, structured=StructuredSpec.choice(["yes", "no"]))])
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    for o, m in zip(mixed[2:5], MODELS):
        m.model_validate_json(o.outputs[0].text)
    assert mixed[5].outputs[0].text in ("yes", "no")


def test_n_choices_each_follow_the_grammar(llm):
    out = llm.generate([PROMPT], _json(Order, temperature=1.0, seed=3, n=4))[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        Order.model_validate_json(c.text)
    assert len({c.text for c in out.outputs}) > 1
    regex = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=20,
                           structured=StructuredSpec.regex(r"[A-Z]{2}-\d{3}"))
    for c in llm.generate([PROMPT], regex)[0].outputs:
        assert len(c.text) == 6 and c.text[2] == "-" and c.text[:2].isupper() and c.text[3:].isdigit()


def test_preemption_keeps_constrained_outputs():
    params = [_json(m, temperature=1.0, seed=s, max_tokens=300) for m in MODELS for s in range(4)]
    roomy = LLM(model_dir("tiny"), num_kv_blocks=512)
    tight = LLM(model_dir("tiny"), num_kv_blocks=24, block_size=16)     # 384 tokens for 12 requests
    a = [o.outputs[0].text for o in roomy.generate([PROMPT] * len(params), params)]
    b = [o.outputs[0].text for o in tight.generate([PROMPT] * len(params), params)]
    assert tight.engine.stats().num_preemptions > 0
    assert a == b


def test_speculative_decoding_with_grammars():
    """Prompt-lookup drafts are checked by the grammar (bitmask per draft row, then rollback):
    greedy constrained output is the same with and without speculation."""
    params = [_json(m, temperature=0, max_tokens=200) for m in MODELS]
    params += [_json(m, temperature=1.0, seed=5) for m in MODELS]
    prompt = [5, 17, 99, 4, 23] * 8
    plain = LLM(model_dir("tiny"), num_kv_blocks=512)
    spec = LLM(model_dir("tiny"), num_kv_blocks=512,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                   "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    a = plain.generate([prompt] * len(params), params)
    b = spec.generate([prompt] * len(params), params)
    assert [o.outputs[0].text for o in a[:3]] == [o.outputs[0].text for o in b[:3]]
    for o, m in zip(b, MODELS * 2):
        m.model_validate_json(o.outputs[0].text)
    assert spec.engine.stats_recorder.snapshot(spec.engine.scheduler, spec.engine.kv) is not None


def test_abort_frees_a_constrained_request(llm):
    eng = llm.engine
    eng.add_request("s-abort", PROMPT, _json(Person, temperature=1.0, seed=1))
    eng.step()
    eng.step()
    assert eng.abort_request("s-abort")
    finals = eng.step()
    assert [d.finish_reason for d in finals if d.request_id == "s-abort"] == ["abort"]
    assert not eng.has_unfinished() and eng.stats().kv.num_used_blocks == 0


def test_required_tool_calls_always_parse(llm):
    from backend.structured.spec import spec_from_params
    from client.shim.tools import parse_tool_calls

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}},
             {"type": "function", "function": {"name": "get_time", "parameters": {
                 "type": "object", "properties": {"tz": {"type": "string", "maxLength": 6}}, "required": ["tz"]}}}]
    for choice, parallel in (("required", False), ("required", True),
                             ({"type": "function", "function": {"name": "get_time"}}, True)):
        spec = spec_from_params({"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel})
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=300, structured=spec) for s in range(10)]
        for o in llm.generate([PROMPT] * len(params), params):
            c = o.outputs[0]
            assert c.finish_reason == "stop", c.text
            content, calls = parse_tool_calls(c.text)
            assert content == "" and calls and (parallel or len(calls) == 1), c.text
            for call in calls:
                args = json.loads(call["arguments"])
                if choice != "required":
                    assert call["name"] == "get_time"
                assert set(args) == ({"city", "unit"} if call["name"] == "get_weather" else {"tz"})
