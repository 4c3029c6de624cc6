"""The response thread merges a choice's backlog of deltas: the text must not change."""
from __future__ import annotations

import random

import pytest

from backend import LLM, SamplingParams
from backend.detokenizer import decode_delta
from backend.serving.engine_service import coalesce
from tests.conftest import model_dir

PROMPTS = ["你好，世界！", "Emoji 😀🎉 and naïve café", "  leading spaces  and   gaps "]


@pytest.fixture(scope="module")
def llm():
    return LLM(str(model_dir("tiny")), num_kv_blocks=64, max_num_seqs=8)


def run_stream(llm, params):
    """Every StepDelta of the prompts, in the order the engine produced them, plus final texts."""
    engine = llm.engine
    ids = [llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    for i, p in enumerate(ids):
        engine.add_request(f"r{i}", p, params)
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    finals = llm.generate([list(p) for p in ids], params)
    return deltas, [o.outputs[0].text for o in finals]


def texts(llm, items) -> dict[str, str]:
    out: dict[str, str] = {}
    for h, d in items:
        out[d.request_id] = out.get(d.request_id, "") + decode_delta(
            llm.tokenizer, d.window_ids, d.num_sent, final=d.finished, max_chars=d.max_chars)
    return out


@pytest.mark.parametrize("stop", [[], ["a", "的"]])
def test_coalesced_backlogs_stream_the_same_text(llm, stop):
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=stop)
    deltas, finals = run_stream(llm, params)
    handles = {d.request_id: object() for d in deltas}   # the service's per-request handles
    items = [(handles[d.request_id], d) for d in deltas]
    rng = random.Random(0)
    merged_any = False
    for _ in range(20):
        out, i = [], 0
        while i < len(items):                 # random backlog sizes, like a busy response thread
            n = rng.randint(1, 12)
            batch = coalesce(items[i:i + n])
            merged_any |= len(batch) < len(items[i:i + n])
            out += batch
            i += n
        got = texts(llm, out)
        assert [got[f"r{k}"] for k in range(len(PROMPTS))] == finals
        for rid in got:                       # every token still delivered, in order
            ids = [t for _, d in out if d.request_id == rid for t in d.new_token_ids]
            assert ids == [t for _, d in items if d.request_id == rid for t in d.new_token_ids]
    assert merged_any


def test_other_items_keep_their_place():
    items = [("open", 1), ("control", "x"), ("reject", 2, None)]
    assert coalesce(items) == items
