"""Scheduler against the real KV manager (allocator only, no storage): exact chunks and order."""
from __future__ import annotations

from backend.engine.scheduler import Scheduler
from backend.engine.sequence import Request, SeqStatus
from backend.outputs import StopChecker
from backend.kv_cache.manager import KVCacheManager
from backend.engine.admission import SamplingParams
from tests.unit.kv_helpers import free_blocks

BS = 4
EOS = 99


def make(num_blocks=32, budget=16, max_seqs=8, caching=False):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BS, enable_prefix_caching=caching)
    stop = StopChecker(None, [EOS], max_model_len=1024)
    return kv, Scheduler(kv, max_num_seqs=max_seqs, max_num_batched_tokens=budget, stop_checker=stop)


def req(rid, n_prompt, *, priority=0, arrival=0.0, n=1, first=0, max_tokens=50):
    return Request(rid, list(range(first, first + n_prompt)), SamplingParams(n=n, max_tokens=max_tokens),
                   max_tokens=max_tokens, stream=True, salt=None, priority=priority, deadline=None,
                   arrival_time=arrival)


def run(sched, out, sample_token=7):
    """What the engine does after the model ran: every sampling sequence drew ``sample_token``."""
    return sched.update_from_output(out, [sample_token] * len(out.sampling), [None] * len(out.sampling))


def chunks(out):
    return [(s.seq_id, n) for s, n in out.scheduled]


def test_chunked_prefill_keeps_decodes_running_under_one_budget():
    kv, sched = make(budget=8)
    a = req("a", 3, arrival=0)
    sched.add(a.seqs[0])
    out = sched.schedule()
    assert chunks(out) == [("a#0", 3)] and out.num_batched_tokens == 3
    run(sched, out)
    b = req("b", 20, arrival=1)
    sched.add(b.seqs[0])
    # a decodes (1 token), b's prompt takes the rest of the budget, chunk by chunk
    seen = []
    for _ in range(3):
        out = sched.schedule()
        seen.append(chunks(out))
        run(sched, out)
    assert seen == [[("a#0", 1), ("b#0", 7)], [("a#0", 1), ("b#0", 7)], [("a#0", 1), ("b#0", 6)]]
    assert b.seqs[0].num_computed_tokens == 20 and b.seqs[0].num_tokens == 21
    assert kv.block_table("b#0") and len(kv.block_table("b#0")) == 5
    kv.check_integrity()


def test_waiting_order_is_priority_then_arrival_and_respects_max_num_seqs():
    kv, sched = make(budget=100, max_seqs=2)
    for rid, prio, arr in [("late", 0, 3.0), ("low", 5, 0.0), ("early", 0, 1.0), ("urgent", -1, 9.0)]:
        sched.add(req(rid, 2, priority=prio, arrival=arr).seqs[0])
    out = sched.schedule()
    assert chunks(out) == [("urgent#0", 2), ("early#0", 2)]
    assert sched.num_waiting == 2


def test_n_reserves_its_seats_before_the_fork():
    kv, sched = make(budget=100, max_seqs=3)
    sched.add(req("one", 2, arrival=0).seqs[0])
    sched.add(req("three", 2, arrival=1, n=3).seqs[0])
    out = sched.schedule()
    assert chunks(out) == [("one#0", 2)]      # 1 + 3 seats > 3: "three" waits


def test_out_of_blocks_preempts_latest_arrival_and_it_recomputes_later():
    kv, sched = make(num_blocks=4, budget=100)
    a, b = req("a", 7, arrival=0), req("b", 7, arrival=1)
    sched.add(a.seqs[0])
    sched.add(b.seqs[0])
    out = sched.schedule()
    assert chunks(out) == [("a#0", 7), ("b#0", 7)]      # 2 blocks each: pool full
    run(sched, out)
    run(sched, sched.schedule())                         # 8 tokens each: still 2 blocks
    out = sched.schedule()                               # a's 9th token needs a third block
    assert [s.seq_id for s in out.preempted] == ["b#0"]
    assert chunks(out) == [("a#0", 1)]
    seq_b = b.seqs[0]
    assert seq_b.status is SeqStatus.WAITING and seq_b.num_computed_tokens == 0
    assert seq_b.num_preemptions == 1 and sched.num_preemptions == 1
    assert free_blocks(kv) == 1                           # b#0 gave its 2 blocks back
    kv.check_integrity()
    run(sched, out)
    sched.finish(a.seqs[0])
    out = sched.schedule()
    assert chunks(out) == [("b#0", 9)]                   # prompt + its sampled tokens, recomputed
    kv.check_integrity()


def test_lone_sequence_that_cannot_grow_preempts_itself():
    kv, sched = make(num_blocks=2, budget=100)
    a = req("a", 8)
    sched.add(a.seqs[0])
    run(sched, sched.schedule())
    out = sched.schedule()
    assert out.scheduled == [] and [s.seq_id for s in out.preempted] == ["a#0"]
    assert free_blocks(kv) == 2


def test_higher_priority_waiting_request_preempts_lower_priority_running():
    kv, sched = make(num_blocks=4, budget=100)
    low = req("low", 12, priority=3, arrival=0)
    sched.add(low.seqs[0])
    run(sched, sched.schedule())                          # low holds 3 of 4 blocks
    high = req("high", 8, priority=0, arrival=1)
    sched.add(high.seqs[0])
    out = sched.schedule()
    assert [s.seq_id for s in out.preempted] == ["low#0"]
    assert chunks(out) == [("high#0", 8)]
    kv.check_integrity()


def test_finish_frees_running_and_drops_waiting():
    kv, sched = make(budget=4)
    a, b = req("a", 10, arrival=0), req("b", 3, arrival=1)
    sched.add(a.seqs[0])
    sched.add(b.seqs[0])
    out = sched.schedule()
    assert chunks(out) == [("a#0", 4)]
    sched.finish(a.seqs[0])
    sched.finish(b.seqs[0])
    assert free_blocks(kv) == 32 and sched.num_waiting == 0 and not sched.running
    assert sched.schedule().scheduled == []


def test_prefix_hit_skips_cached_tokens():
    kv, sched = make(budget=100, caching=True)
    a = req("a", 10)
    sched.add(a.seqs[0])
    run(sched, sched.schedule())
    sched.finish(a.seqs[0])
    b = req("b", 10, arrival=1)
    sched.add(b.seqs[0])
    out = sched.schedule()
    assert chunks(out) == [("b#0", 2)]                    # two full blocks (8 tokens) cached
    assert b.num_cached_tokens == 8 and out.new_requests == [b]


def test_update_from_output_forks_n_choices_onto_the_prompt_blocks_and_finishes():
    kv, sched = make(budget=100)
    r = req("r", 6, n=3, max_tokens=2)
    sched.add_request(r)
    out = sched.schedule()
    # one logits row (the prompt's), sampled by choice 0 and its two new siblings
    assert chunks(out) == [("r#0", 6)]
    assert [s.seq_id for s in out.sampling] == ["r#0", "r#1", "r#2"] and out.logit_rows == [0, 0, 0]
    assert not r.forked and len(r.seqs) == 1                  # registered only after the model ran
    outcome = sched.update_from_output(out, [7, 8, EOS], [None] * 3)
    assert r.forked and [s.output_ids for s in r.seqs] == [[7], [8], [EOS]]
    assert (outcome.computed_tokens, outcome.recomputed_tokens) == (6, 0)
    assert [s.seq_id for s in outcome.finished] == ["r#2"] and r.seqs[2].finish_reason == "stop"
    # choices 0 and 1 share both prompt blocks; choice 2 stopped and gave its references back
    assert kv.block_table("r#0") == kv.block_table("r#1")
    assert [kv.pool.blocks[b].ref_cnt for b in kv.block_table("r#0")] == [2, 2]
    assert set(sched.running) == {r.seqs[0], r.seqs[1]} and "r" in sched.requests
    out = sched.schedule()
    assert chunks(out) == [("r#0", 1), ("r#1", 1)] and out.logit_rows is None
    outcome = run(sched, out)
    assert [s.finish_reason for s in outcome.finished] == ["length", "length"]
    assert "r" not in sched.requests and not sched.running and free_blocks(kv) == 32
    kv.check_integrity()


def test_finish_request_before_the_prompt_ran_still_finishes_every_choice():
    kv, sched = make(budget=4)
    r = req("r", 10, n=2)
    sched.add_request(r)
    run(sched, sched.schedule())                              # a first chunk of 4: blocks held
    done = sched.finish_request(r, "abort", None)
    assert [(s.index, s.finish_reason) for s in done] == [(0, "abort"), (1, "abort")]
    assert "r" not in sched.requests and free_blocks(kv) == 32 and sched.num_waiting == 0
