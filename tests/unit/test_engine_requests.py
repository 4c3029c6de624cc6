"""Admission and request lifecycle: validation, queue bound, abort, deadlines, priorities, stats."""
from __future__ import annotations

import time

import pytest

from backend import SamplingParams
from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.errors import EngineError, ErrorKind
from tests.conftest import model_dir

P = list(range(100, 140))


def engine(**kw):
    kw.setdefault("num_kv_blocks", 64)
    return LLMEngine(model_dir("tiny"), EngineConfig(num_threads=1, **kw))


def drain(eng):
    out = []
    while eng.has_unfinished():
        out.extend(eng.step())
    return out


def assert_invalid(eng, prompt, params, *, param: str, match: str, request_id: str = "a") -> None:
    """Rejected as invalid_request naming ``param`` (set where it was raised, not parsed)."""
    with pytest.raises(EngineError, match=match) as info:
        eng.add_request(request_id, prompt, params)
    assert (info.value.kind, info.value.param) == (ErrorKind.INVALID_REQUEST, param)


def test_invalid_requests_raise_invalid_request_errors_naming_the_field():
    eng = engine(max_model_len=64, num_kv_blocks=64)
    assert_invalid(eng, list(range(80)), SamplingParams(), param="input_ids",
                   match=r"prompt has 80 tokens.*max_model_len is 64")
    assert_invalid(eng, P, SamplingParams(max_tokens=30), param="max_tokens",
                   match=r"prompt has 40 tokens and max_tokens is 30.*70.*64")
    assert_invalid(eng, [], SamplingParams(), param="input_ids", match="empty")
    assert_invalid(eng, [1, 99999], SamplingParams(), param="input_ids",
                   match=r"token ids must be integers in \[0, 3130\)")
    assert_invalid(eng, P, SamplingParams(max_tokens=4, min_tokens=5), param="min_tokens", match="min_tokens")
    assert_invalid(engine(max_num_seqs=2), P, SamplingParams(n=3), param="n", match="max_num_seqs")
    assert_invalid(eng, P, SamplingParams(), param="request_id", match="non-empty", request_id="")
    changed = SamplingParams()
    changed.top_p = 0.0                                     # changed after construction
    assert_invalid(eng, P, changed, param="top_p", match="top_p")
    eng.add_request("a", P, SamplingParams(max_tokens=None))            # the rest of the context
    assert eng.scheduler.requests["a"].max_tokens == 24
    assert_invalid(eng, P, SamplingParams(), param="request_id", match="already in use")
    # the context limit is also what the KV pool can hold for one sequence
    assert engine(num_kv_blocks=4, block_size=16).max_model_len == 64


def test_queue_full_raises_with_retry_after():
    eng = engine(max_waiting=2)
    eng.add_request("a", P, SamplingParams())
    eng.add_request("b", P, SamplingParams())
    with pytest.raises(EngineError) as info:
        eng.add_request("c", P, SamplingParams())
    err = info.value
    assert err.kind is ErrorKind.QUEUE_FULL and err.retry_after == 1.0
    assert str(err) == "2 requests are waiting (max_waiting=2)"      # the tag is serving's job
    assert eng.stats().num_rejected == 1
    eng.step()                                    # both admitted: room again
    eng.add_request("c", P, SamplingParams())


def test_abort_frees_every_block_at_once_and_finishes_every_choice():
    eng = engine(max_num_seqs=4)
    eng.add_request("run", P, SamplingParams(max_tokens=50, ignore_eos=True))
    eng.add_request("fork", P[:20], SamplingParams(n=3, max_tokens=50, temperature=1.0))
    eng.add_request("wait", P, SamplingParams(n=2), priority=5)
    for _ in range(3):
        eng.step()
    assert eng.stats().kv.num_used_blocks > 0 and eng.stats().num_waiting == 1
    assert eng.abort_request("run") and eng.abort_request("fork") and eng.abort_request("wait")
    assert not eng.abort_request("run") and not eng.abort_request("nope")
    stats = eng.stats()
    assert stats.kv.num_used_blocks == 0 and stats.num_running == 0 and stats.num_waiting == 0
    eng.kv.check_integrity()
    finals = drain(eng)
    assert sorted((d.request_id, d.index) for d in finals) == [
        ("fork", 0), ("fork", 1), ("fork", 2), ("run", 0), ("wait", 0), ("wait", 1)]
    assert all(d.finished and d.finish_reason == "abort" for d in finals)
    assert eng.stats().num_aborted == 3 and eng.stats().finished["abort"] == 6


def test_deadlines_expire_waiting_and_running_requests():
    eng = engine(max_num_seqs=1)
    now = time.monotonic()
    eng.add_request("running", P, SamplingParams(max_tokens=50, ignore_eos=True), deadline=now + 60)
    eng.add_request("waiting", P, SamplingParams(), deadline=now - 1)
    first = eng.step()
    assert [(d.request_id, d.finish_reason, d.error and d.error.kind) for d in first if d.finished] == [
        ("waiting", "abort", ErrorKind.DEADLINE)]
    eng.step()
    eng.scheduler.requests["running"].deadline = time.monotonic()        # passes while it runs
    finals = []
    while eng.has_unfinished():
        finals += [d for d in eng.step() if d.finished]
    assert [(d.request_id, d.finish_reason, d.error and d.error.kind) for d in finals] == [
        ("running", "abort", ErrorKind.DEADLINE)]
    assert finals[0].completion_tokens == 2
    assert eng.stats().num_deadline_exceeded == 2 and eng.stats().kv.num_used_blocks == 0


def test_lower_priority_value_runs_first_and_stats_count():
    eng = engine(max_num_seqs=1)
    eng.add_request("later", P, SamplingParams(max_tokens=3, temperature=0), priority=1, stream=False)
    eng.add_request("sooner", P, SamplingParams(max_tokens=3, temperature=0), priority=0, stream=False)
    order = [d.request_id for d in drain(eng)]
    assert order == ["sooner", "later"]
    s = eng.stats()
    assert s.prompt_tokens == 80 and s.generation_tokens == 6 and s.finished == {"length": 2}
    assert s.cached_prompt_tokens == 32            # "later" reuses the first 2 blocks of "sooner"
    assert s.computed_tokens == s.useful_tokens == 80 - 32 + 4
