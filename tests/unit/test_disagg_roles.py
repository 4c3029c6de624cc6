"""The engine model's role wrappers (backend/serving/disagg_engine.py) without Triton: a prefill
EngineLoop ends a request with the hand-over delta, a DecodeLoop continues it from the record to
the unified engine's output, and aborts after the hand-over release the staged KV."""
from __future__ import annotations

import json
import queue
import threading
import time

import pytest

from backend.config import EngineArgs
from backend.engine.engine_loop import EngineLoop
from backend.engine.llm_engine import LLMEngine
from backend.errors import EngineError
from backend.engine.admission import SamplingParams
from backend.serving.disagg_engine import DecodeLoop, HandoverDelta, build_role
from backend.serving.postprocess import engine_outputs
from tests.conftest import model_dir

PROMPT = [(7 * i) % 3000 + 5 for i in range(70)]
PARAMS = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)


def _args(role: str) -> EngineArgs:
    return EngineArgs(num_kv_blocks=64, block_size=16, max_num_batched_tokens=256, num_threads=1, role=role)


@pytest.fixture(scope="module")
def loops():
    built = {}
    for role in ("prefill", "decode"):
        args = _args(role)
        engine, loop_cls = build_role(LLMEngine(model_dir("tiny"), args.engine), args.disagg)
        built[role] = loop_cls(engine)
    yield built
    for loop in built.values():
        loop.shutdown(drain=False, timeout=2)
        loop.engine.close_role()


def _drain(q: queue.Queue, timeout: float = 60.0) -> list:
    out = []
    while True:
        d = q.get(timeout=timeout)
        out.append(d)
        if d.finished:
            return out


def _unified_tokens(prompt: list[int] = PROMPT) -> list[int]:
    eng = LLMEngine(model_dir("tiny"), _args("unified").engine)
    eng.add_request("u", prompt, PARAMS)
    toks = []
    while eng.has_unfinished():
        for d in eng.step():
            toks += d.new_token_ids
    return toks


def test_prefill_hands_over_and_decode_continues_to_the_unified_output(loops):
    pre, dec = loops["prefill"], loops["decode"]
    q: queue.Queue = queue.Queue()
    pre.submit("r1", PROMPT, PARAMS, sink=q)
    (final,) = _drain(q)
    assert isinstance(final, HandoverDelta) and final.finish_reason == "handover" and final.new_token_ids == []
    assert json.loads(engine_outputs(final)["metrics"][0])["handover"] == final.handover   # on the wire
    assert pre.stats().kv_usage == 0 and pre.engine.connector.num_staged() == 1           # pool freed, KV staged
    with pytest.raises(EngineError, match="differs from input_ids"):
        dec.submit("r1", PROMPT[:-1], PARAMS, sink=q, handover=final.handover)
    dec.submit("r1", PROMPT, PARAMS, sink=q, handover=final.handover)
    got = [t for d in _drain(q) for t in d.new_token_ids]
    assert got == _unified_tokens()
    assert dec.engine.role.stats.admitted == 1 and dec.engine.role.stats.recomputed == 0


def test_abort_after_the_hand_over_releases_the_staged_kv(loops):
    pre = loops["prefill"]
    q: queue.Queue = queue.Queue()
    pre.submit("r2", PROMPT[::-1], PARAMS, sink=q)
    _drain(q)
    assert pre.engine.connector.num_staged() >= 1
    staged = pre.engine.connector.num_staged()
    assert pre.abort("r2").result(timeout=10) is not None          # found: its staged KV released
    assert pre.engine.connector.num_staged() == staged - 1
    assert pre.abort("r2").result(timeout=10) is None              # once


def test_a_unified_loop_takes_no_records():
    assert not getattr(EngineLoop, "accepts_handover", False) and DecodeLoop.accepts_handover


LONG = [(11 * i) % 3000 + 5 for i in range(200)]       # 13 blocks: fetched and written by the placer


def _handover(pre, rid: str, prompt: list[int]) -> str:
    q: queue.Queue = queue.Queue()
    pre.submit(rid, prompt, PARAMS, sink=q)
    (final,) = _drain(q)
    assert final.finish_reason == "handover"
    return final.handover


class _GatedConnector:
    """The decode connector, but fetch waits until the test opens the gate."""

    def __init__(self, inner) -> None:
        self.inner, self.gate, self.entered = inner, threading.Event(), threading.Event()

    def fetch(self, *a, **kw):
        self.entered.set()
        assert self.gate.wait(30)
        return self.inner.fetch(*a, **kw)


def _wait_for(cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_a_large_hand_over_is_placed_off_the_step_while_streams_run(loops):
    """While a stream decodes, a 200-token prompt's KV is fetched and written by the placer
    thread (not inside a step) and the continuation equals the unified engine's."""
    pre, dec = loops["prefill"], loops["decode"]
    busy: queue.Queue = queue.Queue()
    dec.submit("busy1", PROMPT, SamplingParams(temperature=0, max_tokens=400, min_tokens=400), sink=busy)
    _wait_for(lambda: dec.engine.scheduler.running)
    before = dec.engine.role.stats.placed_async
    q: queue.Queue = queue.Queue()
    dec.submit("long1", LONG, PARAMS, sink=q, handover=_handover(pre, "long1", LONG))
    assert [t for d in _drain(q) for t in d.new_token_ids] == _unified_tokens(LONG)
    assert dec.engine.role.stats.placed_async == before + 1 and dec.engine.role.stats.recomputed == 0
    assert dec.abort("busy1").result(timeout=10) is not None
    _drain(busy)
    _wait_for(lambda: dec.engine.kv.stats().num_used_blocks == 0)
    assert not dec.engine.role.placing and pre.engine.connector.num_staged() == 0


def test_abort_while_the_placer_writes_frees_the_blocks_once_it_is_done(loops):
    pre, dec = loops["prefill"], loops["decode"]
    placer = dec.engine.placer
    gated = _GatedConnector(placer.connector)
    placer.connector = gated
    stats = dec.engine.role.stats
    aborted, admitted = stats.aborted_pending, stats.admitted
    try:
        busy: queue.Queue = queue.Queue()
        dec.submit("busy2", PROMPT, SamplingParams(temperature=0, max_tokens=400, min_tokens=400), sink=busy)
        _wait_for(lambda: dec.engine.scheduler.running)
        q: queue.Queue = queue.Queue()
        other = LONG[::-1]                                 # not in the decode pool's prefix cache
        dec.submit("long2", other, PARAMS, sink=q, handover=_handover(pre, "long2", other))
        assert gated.entered.wait(30)                      # its blocks are allocated, the copy waits
        kv, seq_id = dec.engine.kv, dec.engine.role.placing["long2"].seq.seq_id
        held = kv.block_table(seq_id)                      # (busy2 keeps growing: count long2's own)
        assert len(held) == -(-len(other) // 16)
        assert dec.abort("long2").result(timeout=10) is not None
        (final,) = _drain(q)
        assert final.finish_reason == "abort" and final.new_token_ids == []
        assert kv.block_table(seq_id) == held              # not freed under the placer's writes
        gated.gate.set()
        _wait_for(lambda: not dec.engine.role.placing)
        with pytest.raises(KeyError):                      # freed once the placer was done
            kv.block_table(seq_id)
        assert dec.abort("busy2").result(timeout=10) is not None
        _drain(busy)
        _wait_for(lambda: dec.engine.kv.stats().num_used_blocks == 0)
        assert (stats.aborted_pending, stats.admitted) == (aborted + 1, admitted)   # never scheduled
        assert pre.engine.connector.num_staged() == 0         # the segment was consumed or released
    finally:
        placer.connector = gated.inner


def test_a_forged_record_is_that_requests_400_and_the_loop_keeps_serving(loops):
    pre, dec = loops["prefill"], loops["decode"]
    good = json.loads(_handover(pre, "f1", PROMPT))
    q: queue.Queue = queue.Queue()
    for over in ({"queue_time": "soon"}, {"generator_state": "AAAA"}, {"first_token": 10 ** 9},
                 {"num_kv_tokens": 3}, {"locator": {**good["locator"], "shape": [10 ** 6, 1]}}):
        with pytest.raises(EngineError, match="bad hand-over record") as err:
            dec.submit("f1", PROMPT, PARAMS, sink=q, handover=json.dumps({**good, **over}))
        assert err.value.param == "handover"
    assert q.empty() and dec.healthy and not dec.engine.role.busy()
    dec.submit("f1", PROMPT, PARAMS, sink=q, handover=json.dumps(good))
    assert [t for d in _drain(q) for t in d.new_token_ids] == _unified_tokens()


def test_the_decode_side_takes_the_callers_salt_and_cannot_fetch_another_tenants_kv(loops):
    """The record was staged for tenant a; the continuation arrives as tenant b: the transfer is
    refused (and stays staged for a), b's request is recomputed to the same tokens."""
    pre, dec = loops["prefill"], loops["decode"]
    q: queue.Queue = queue.Queue()
    pre.submit("t1", PROMPT[5:], PARAMS, sink=q, salt="tenant:a")
    (final,) = _drain(q)
    staged = pre.engine.connector.num_staged()
    stats = dec.engine.role.stats
    admitted, recomputed = stats.admitted, stats.recomputed
    dec.submit("t1", PROMPT[5:], PARAMS, sink=q, handover=final.handover, salt="tenant:b")
    assert [t for d in _drain(q) for t in d.new_token_ids] == _unified_tokens(PROMPT[5:])
    assert (stats.admitted, stats.recomputed) == (admitted, recomputed + 1)
    assert pre.engine.connector.num_staged() == staged                # still tenant a's
    assert pre.abort("t1").result(timeout=10) is not None               # a's abort releases it
    assert pre.engine.connector.num_staged() == staged - 1


def test_the_callers_deadline_bounds_a_continuation_whatever_the_record_says(loops):
    pre, dec = loops["prefill"], loops["decode"]
    record = json.loads(_handover(pre, "dl1", PROMPT[3:]))
    record["deadline_in"] = 1e6                        # the record would allow ~11 days
    q: queue.Queue = queue.Queue()
    long = SamplingParams(temperature=0, max_tokens=400, min_tokens=400)
    record["params"] = {**record["params"], "max_tokens": 400, "min_tokens": 400}
    record["max_tokens"] = 400
    dec.submit("dl1", PROMPT[3:], long, sink=q, handover=json.dumps(record), deadline=time.monotonic())
    out = _drain(q)
    assert out[-1].finished and out[-1].error is not None and len([t for d in out for t in d.new_token_ids]) < 400
    _wait_for(lambda: dec.engine.kv.stats().num_used_blocks == 0)
