"""The response thread merges a choice's backlog of deltas: the text must not change."""
from __future__ import annotations

import random

import pytest

from backend import LLM, SamplingParams
from backend.outputs import decode_delta
from backend.errors import deadline_exceeded
from backend.outputs import StepDelta
from backend.serving.hold_policy import coalesce, merge_deltas
from backend.serving.intake import ControlAnswered, DeltaArrived, Opened, Rejected, RequestHandle
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
    for m in items:
        d = m.delta
        out[d.request_id] = out.get(d.request_id, "") + decode_delta(
            llm.tokenizer, d.window_ids, d.num_sent, final=d.finished, max_chars=d.max_chars)
    return out


@pytest.mark.parametrize("stop", [[], ["a", "的"]])
def test_coalesced_backlogs_stream_the_same_text(llm, stop):
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=stop)
    deltas, finals = run_stream(llm, params)
    handles = {d.request_id: RequestHandle(d.request_id, None, 0.0) for d in deltas}
    items = [DeltaArrived(handles[d.request_id], d) for d in deltas]
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
            ids = [t for m in out if m.delta.request_id == rid for t in m.delta.new_token_ids]
            assert ids == [t for m in items if m.delta.request_id == rid for t in m.delta.new_token_ids]
    assert merged_any


def _d(rid, ids, **kw):
    return StepDelta(rid, kw.pop("index", 0), ids, ids, 0, **kw)


def test_other_messages_keep_their_place_and_deltas_merge_around_them():
    a, b = RequestHandle("a", None, 0.0), RequestHandle("b", None, 0.0)
    opened, rejected = Opened(b), Rejected(b, deadline_exceeded())
    control = ControlAnswered("x", None, 0.0, None)
    out = coalesce([opened, DeltaArrived(a, _d("a", [1])), control, DeltaArrived(a, _d("a", [2])),
                    DeltaArrived(a, _d("a", [3], index=1)), rejected])
    assert out[0] is opened and out[2] is control and out[4] is rejected and len(out) == 5
    assert out[1].handle is a and out[1].delta.new_token_ids == [1, 2] and out[1].delta.window_ids == [1, 2]
    assert out[3].delta.index == 1 and out[3].delta.new_token_ids == [3]


@pytest.mark.parametrize("first, second", [
    (_d("a", [1], finished=True, finish_reason="length"), _d("a", [2])),     # nothing follows a final
    (_d("a", [1], max_chars=0), _d("a", [2])),                                # stop-string cuts are per window
    (_d("a", [1]), _d("a", [2], max_chars=1)),
    (_d("a", [1]), _d("a", [], finished=True, finish_reason="abort", error=deadline_exceeded())),
])
def test_deltas_that_must_stay_apart(first, second):
    assert merge_deltas(first, second) is None
    h = RequestHandle("a", None, 0.0)
    assert [m.delta for m in coalesce([DeltaArrived(h, first), DeltaArrived(h, second)])] == [first, second]


def test_a_final_takes_the_backlog_before_it():
    h = RequestHandle("a", None, 0.0)
    (m,) = coalesce([DeltaArrived(h, _d("a", [1])), DeltaArrived(h, _d("a", [2], finished=True,
                                                                          finish_reason="stop"))])
    assert m.delta.new_token_ids == [1, 2] and m.delta.finished and m.delta.finish_reason == "stop"
