"""Cancel and abort through a real tritonserver: KV blocks freed within a step, metrics show it.

A gRPC stream cancel reaches the engine model when it is called directly, but not the engine step
inside the ``llm`` ensemble, so ensemble clients also send an explicit abort (parameter
``abort_request_id`` to model ``engine``).
"""
from __future__ import annotations

import uuid

import pytest

from tests.e2e.helpers import Result, Stream, abort, generate, make_inputs, metric, scrape, wait_metric
from tests.e2e.settle import settled

pytestmark = pytest.mark.e2e

LONG = dict(max_tokens=900, temperature=0.0, ignore_eos=True)


def _idle(server) -> dict:
    # settled, not just idle gauges: an earlier test's counters (aborts, histograms) are written
    # at the metrics thread's poll, after the gauges, and the deltas below are exact
    return settled(lambda: scrape(server), ready=lambda s: metric(s, "llm_num_requests_running") == 0
                   and metric(s, "llm_num_requests_waiting") == 0)


def _start(server, model: str, **inputs) -> tuple[Stream, Result]:
    s = Stream(server)
    res = Result(uuid.uuid4().hex)
    s.send(model, make_inputs(**inputs), res.request_id, LONG)
    s.collect(res, until_responses=5, timeout=60)
    assert res.error is None                 # finished already (a starved client)? the counters say so
    return s, res


TRIES = 3


def _finished_by_length(snap: dict, before: dict) -> bool:
    return metric(snap, "llm_requests_finished_total", reason="length") > \
        metric(before, "llm_requests_finished_total", reason="length")


def _until_the_abort_wins(server, act):
    """Run ``act`` (start a 900-token request, then cancel or abort it) until the abort reached
    the request before its last token, and return what ``act`` returned. A loaded host can starve
    this client between the request's 5th response and its abort while the engine thread (nice
    -19) runs the request to its end; the counters tell the two outcomes apart (finished by length,
    or aborted: once, by reason abort, its blocks back). Such a try shows nothing, so it runs again,
    3 times at most. No wall-clock bound: a loaded CI host is 5-10x slower."""
    for _ in range(TRIES):
        before = _idle(server)
        seen = act(before)
        snap = settled(lambda: scrape(server), ready=lambda s: (
            metric(s, "llm_num_requests_running") == 0
            and metric(s, "llm_kv_cache_usage_ratio") == metric(before, "llm_kv_cache_usage_ratio")
            and (_finished_by_length(s, before) or (
                metric(s, "llm_requests_aborted_total") >= metric(before, "llm_requests_aborted_total") + 1
                and metric(s, "llm_abort_to_free_seconds_count")
                >= metric(before, "llm_abort_to_free_seconds_count") + 1))))
        if _finished_by_length(snap, before):
            continue
        assert metric(snap, "llm_requests_aborted_total") == metric(before, "llm_requests_aborted_total") + 1
        assert metric(snap, "llm_abort_to_free_seconds_count") == \
            metric(before, "llm_abort_to_free_seconds_count") + 1
        assert metric(snap, "llm_requests_finished_total", reason="abort") == \
            metric(before, "llm_requests_finished_total", reason="abort") + 1
        return seen
    pytest.fail(f"the request ran to its end before the abort in each of {TRIES} tries")


def test_ensemble_stream_cancel_plus_explicit_abort(triton_server):
    def act(before):
        s, res = _start(triton_server, "llm", text="Tell me everything about 长城 🏯")
        # the gauge is written by the metrics thread after a batch: wait for it, do not sample it once
        wait_metric(triton_server, lambda m: metric(m, "llm_num_requests_running") == 1
                    or _finished_by_length(m, before), timeout=60)
        s.close(cancel=True)
        return abort(triton_server, res.request_id)

    ctrl = _until_the_abort_wins(triton_server, act)
    assert ctrl.error is None and ctrl.finals == 1 and ctrl.finish_reason == "abort"


def test_ensemble_explicit_abort_ends_the_stream_with_abort(triton_server):
    def act(before):
        s, res = _start(triton_server, "llm", text="Count to a thousand:")
        try:
            ctrl = abort(triton_server, res.request_id)
            if not res.finals:
                s.collect(res, timeout=60)
        finally:
            s.close()
        return ctrl, res

    ctrl, res = _until_the_abort_wins(triton_server, act)
    assert ctrl.finish_reason == "abort"
    assert res.error is None and res.finals == 1 and res.finish_reason == "abort"
    assert 5 <= res.choices[0].final["completion_tokens"] < LONG["max_tokens"]


def test_engine_direct_stream_cancel(triton_server):
    def act(before):
        s, _ = _start(triton_server, "engine", input_ids=[5, 6, 7, 8, 9, 10])
        s.close(cancel=True)                 # no explicit abort: is_cancelled() reaches the engine

    _until_the_abort_wins(triton_server, act)


def test_abort_before_the_request_arrives(triton_server):
    """An abort that overtakes its request (still in preprocessing) is remembered for it."""
    rid = "early-" + uuid.uuid4().hex
    ctrl = abort(triton_server, rid)
    assert ctrl.error is None and ctrl.finals == 1 and ctrl.finish_reason == ""
    res = generate(triton_server, "llm", text="never runs", request_id=rid, **LONG)
    assert res.error is None and res.finals == 1
    assert res.finish_reason == "abort" and res.choices[0].ids == []


def test_abort_after_finish_is_a_no_op(triton_server):
    rid = "done-" + uuid.uuid4().hex
    first = generate(triton_server, "llm", text="short", request_id=rid, max_tokens=3, temperature=0.0)
    assert first.finish_reason in ("stop", "length")
    assert abort(triton_server, rid).finish_reason == ""
    again = generate(triton_server, "llm", text="short", request_id=rid, max_tokens=3, temperature=0.0)
    assert again.text == first.text and again.finish_reason == first.finish_reason
