"""EngineLoop end to end: concurrent requests, abort, admission errors, crash, shutdown."""
from __future__ import annotations

import queue
import threading
import time

import pytest

from backend import SamplingParams
from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.engine.engine_loop import EngineLoop
from backend.errors import EngineError, ErrorKind
from tests.conftest import model_dir

P = list(range(100, 130))


def make_loop(**kw):
    kw.setdefault("num_kv_blocks", 64)
    return EngineLoop(LLMEngine(model_dir("tiny"), EngineConfig(num_threads=1, **kw)))


def collect(q: queue.Queue, n_final: int = 1, timeout: float = 30.0) -> list:
    out, finals = [], 0
    while finals < n_final:
        d = q.get(timeout=timeout)
        out.append(d)
        finals += d.finished
    return out


def test_two_concurrent_requests_and_an_abort():
    loop = make_loop()
    try:
        q_long, got_short = queue.Queue(), []
        done = threading.Event()

        def short_sink(d):
            got_short.append(d)
            if d.finished:
                done.set()

        loop.submit("long", P, SamplingParams(max_tokens=500, ignore_eos=True, temperature=0), sink=q_long)
        loop.submit("short", P[:10], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                    sink=short_sink, stream=False)
        first = q_long.get(timeout=30)                    # the long one is streaming
        assert first.request_id == "long" and len(first.new_token_ids) == 1
        assert done.wait(30)
        assert len(got_short) == 1 and len(got_short[0].new_token_ids) == 8
        assert got_short[0].finish_reason == "length"
        t0 = time.monotonic()
        freed_at = loop.abort("long").result(timeout=30)
        assert freed_at is not None and freed_at >= t0
        rest = collect(q_long)
        assert rest[-1].finish_reason == "abort"
        assert 1 + sum(len(d.new_token_ids) for d in rest) < 500
        assert loop.abort("long").result(timeout=30) is None          # already gone
        deadline = time.monotonic() + 10
        while loop.stats().num_requests and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = loop.stats()
        assert stats.kv.num_used_blocks == 0 and stats.num_aborted == 1 and loop.num_open == 0
        loop.engine.kv.check_integrity()      # the loop is idle, blocked on its intake queue
    finally:
        loop.shutdown(drain=False, timeout=10)
    assert not loop._thread.is_alive()


def _hold_engine_thread(loop, gate: threading.Event) -> None:
    """Submit a request whose sink blocks on ``gate``; return once the engine thread is in it (so
    later submits pile up in the intake, whatever the machine's load)."""
    entered = threading.Event()

    def sink(_delta):
        entered.set()
        gate.wait(30)

    loop.submit("blocker", P, SamplingParams(max_tokens=2), sink=sink)
    assert entered.wait(30), "the engine thread never reached the blocking sink"


def test_submit_rejects_synchronously():
    loop = make_loop(max_waiting=2, max_model_len=64)
    gate = threading.Event()
    try:
        with pytest.raises(EngineError, match="max_model_len") as info:
            loop.submit("x", list(range(100)), SamplingParams(), sink=queue.Queue())
        assert (info.value.kind, info.value.param) == (ErrorKind.INVALID_REQUEST, "input_ids")
        # a sink that blocks holds the engine thread, so later submits pile up in the intake
        _hold_engine_thread(loop, gate)
        loop.submit("a", P, SamplingParams(), sink=queue.Queue())
        loop.submit("b", P, SamplingParams(), sink=queue.Queue())
        with pytest.raises(EngineError) as info:
            loop.submit("c", P, SamplingParams(), sink=queue.Queue())
        assert info.value.kind is ErrorKind.QUEUE_FULL and info.value.retry_after >= 1
        with pytest.raises(EngineError, match="already in use") as info:
            loop.submit("a", P, SamplingParams(), sink=queue.Queue())
        assert (info.value.kind, info.value.param) == (ErrorKind.INVALID_REQUEST, "request_id")
    finally:
        gate.set()
        loop.shutdown(drain=True, timeout=30)
    assert loop.num_open == 0


def test_a_crashing_step_fails_every_open_request_and_marks_unhealthy():
    loop = make_loop()
    calls = {"n": 0}
    execute = loop.engine.runner.execute

    def broken(batch):
        calls["n"] += 1
        if calls["n"] >= 3:
            raise RuntimeError("device fell off the bus")
        return execute(batch)

    loop.engine.runner.execute = broken
    qa, qb = queue.Queue(), queue.Queue()
    loop.submit("a", P, SamplingParams(max_tokens=50, n=2, temperature=1.0), sink=qa)
    loop.submit("b", P[:5], SamplingParams(max_tokens=50), sink=qb)
    finals_a = [d for d in collect(qa, n_final=2) if d.finished]
    finals_b = [d for d in collect(qb) if d.finished]
    for d in finals_a + finals_b:
        assert d.finish_reason == "error" and d.error.kind is ErrorKind.INTERNAL
        assert "device fell off the bus" in str(d.error)
    assert sorted(d.index for d in finals_a) == [0, 1]
    loop._thread.join(10)
    assert not loop.healthy
    with pytest.raises(EngineError, match="not healthy") as info:
        loop.submit("c", P, SamplingParams(), sink=queue.Queue())
    assert info.value.kind is ErrorKind.UNAVAILABLE
    assert loop.abort("a").result(timeout=5) is None
    loop.shutdown(drain=False, timeout=5)


def test_shutdown_drains_open_requests():
    loop = make_loop()
    q = queue.Queue()
    loop.submit("a", P, SamplingParams(max_tokens=20, ignore_eos=True), sink=q, stream=False)
    loop.shutdown(drain=True, timeout=30)
    d = q.get_nowait()
    assert d.finished and d.finish_reason == "length" and len(d.new_token_ids) == 20
    with pytest.raises(EngineError, match="shutting down") as info:
        loop.submit("b", P, SamplingParams(), sink=q)
    assert info.value.kind is ErrorKind.UNAVAILABLE


class ThreadSpy:
    """The real engine, recording which threads read any of its attributes."""

    def __init__(self, engine):
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "threads", set())

    def __getattr__(self, name):
        self.threads.add(threading.current_thread().name)
        return getattr(self._engine, name)


def test_submit_never_reads_engine_state_off_the_engine_thread():
    loop = make_loop(max_waiting=1, max_model_len=64)
    spy = ThreadSpy(loop.engine)
    loop.engine = spy                        # every later self.engine access goes through the spy
    gate = threading.Event()
    try:
        _hold_engine_thread(loop, gate)
        loop.submit("a", P, SamplingParams(), sink=queue.Queue())
        for rid, prompt, params in [("b", P, SamplingParams()),                  # queue_full
                                    ("c", list(range(100)), SamplingParams()),   # too long
                                    ("a", P, SamplingParams())]:                 # duplicate id
            with pytest.raises(EngineError):
                loop.submit(rid, prompt, params, sink=queue.Queue())
    finally:
        gate.set()
        loop.shutdown(drain=True, timeout=30)
    assert spy.threads == {"engine-loop"}


def test_idle_audit_stops_a_loop_whose_allocator_broke():
    """When the engine goes idle the loop runs the KV manager's integrity check; a corrupted pool
    (here: a leaked reference) turns the loop unhealthy instead of serving from it."""
    loop = make_loop()
    try:
        q = queue.Queue()
        loop.submit("a", P, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), sink=q)
        collect(q)
        assert loop.healthy
        kv = loop.engine.kv
        calls = []
        real = kv.check_integrity

        def leak_then_check():
            calls.append(1)
            kv.pool.blocks[0].ref_cnt += 1          # a reference no table holds
            real()

        kv.check_integrity = leak_then_check
        q2 = queue.Queue()
        loop.submit("b", P[:5], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), sink=q2)
        collect(q2)
        deadline = time.monotonic() + 10
        while loop.healthy and time.monotonic() < deadline:
            time.sleep(0.01)
        assert calls and not loop.healthy
        with pytest.raises(EngineError) as exc:
            loop.submit("c", P[:5], SamplingParams(max_tokens=2), sink=queue.Queue())
        assert exc.value.kind is ErrorKind.UNAVAILABLE
    finally:
        loop.shutdown(drain=False)


# -- tenant fairness (backend/engine/admission.py), issue 19 -------------------------------------
def _fair_loop(max_running=2, max_waiting=0, aging_s=0.0, **kw):
    from backend.engine.admission import TenantFairness

    engine = LLMEngine(model_dir("tiny"), EngineConfig(num_threads=1, num_kv_blocks=128, max_num_seqs=4, **kw))
    fair = TenantFairness(max_running_per_tenant=max_running, aging_s=aging_s)
    max_open = max_running + max_waiting if max_waiting else 0
    return EngineLoop(engine, fairness=fair, max_open_per_tenant=max_open)


def _first_token_order(loop, submits, timeout=60.0):
    """Submit (rid, tenant, priority) in order; return rids by first-token time and the most
    sequences any tenant held running at once (sampled on the engine thread via the sink)."""
    firsts, done, peak = [], threading.Event(), {}
    lock = threading.Lock()
    left = [len(submits)]
    tenant_of = {rid: t for rid, t, _ in submits}

    def sink_for(rid):
        def sink(d):
            with lock:
                if rid not in firsts and d.new_token_ids:
                    firsts.append(rid)
                running = {}
                for s in loop.engine.scheduler.running:          # engine thread: safe to read here
                    t = tenant_of.get(s.request.request_id)
                    running[t] = running.get(t, 0) + 1
                for t, c in running.items():
                    peak[t] = max(peak.get(t, 0), c)
                if d.finished:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()
        return sink

    for rid, tenant, prio in submits:
        loop.submit(rid, P, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                    sink=sink_for(rid), tenant=tenant, priority=prio)
    assert done.wait(timeout)
    return firsts, peak


def test_a_flooding_tenant_cannot_take_every_seat():
    loop = _fair_loop(max_running=2)
    try:
        flood = [(f"a{i}", "A", 0) for i in range(12)]
        firsts, peak = _first_token_order(loop, flood + [("b0", "B", 0), ("b1", "B", 0)])
        # B arrived behind 12 of A's requests, yet both of its requests start while A still has
        # most of its flood waiting: A never holds more than its 2 seats of the 4.
        assert peak["A"] == 2
        assert firsts.index("b0") < 4 and firsts.index("b1") < 4, firsts
    finally:
        loop.shutdown(drain=False)


def test_per_tenant_waiting_limit_is_queue_full_for_that_tenant_only():
    loop = _fair_loop(max_running=1, max_waiting=2)
    try:
        sink = queue.Queue()
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        for i in range(3):                  # 1 running + 2 waiting
            loop.submit(f"a{i}", P, long, sink=sink, tenant="A")
        with pytest.raises(EngineError) as info:
            loop.submit("a3", P, long, sink=sink, tenant="A")
        assert info.value.kind is ErrorKind.QUEUE_FULL and "tenant 'A'" in info.value.message
        loop.submit("b0", P, long, sink=sink, tenant="B")       # another tenant is still admitted
    finally:
        loop.shutdown(drain=False)


def test_aging_lets_a_low_priority_request_run_while_high_priority_ones_keep_arriving():
    loop = _fair_loop(max_running=0, aging_s=0.05)
    try:
        started = threading.Event()
        q = queue.Queue()
        loop.submit("low", P, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                    sink=lambda d: started.set() if d.new_token_ids else None, priority=5)
        t_end = time.monotonic() + 20
        i = 0
        while not started.is_set() and time.monotonic() < t_end:   # priority-0 work never stops coming
            for _ in range(4):
                loop.submit(f"h{i}", P, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                            sink=q, priority=0)
                i += 1
            time.sleep(0.05)
        # Without aging "low" waits as long as priority-0 requests keep arriving (here: 20 s).
        assert started.is_set(), f"starved behind {i} requests"
    finally:
        loop.shutdown(drain=False)


def test_abort_only_reaches_a_request_of_the_same_tenant():
    loop = make_loop()
    try:
        q = queue.Queue()
        loop.submit("victim", P, SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True), sink=q,
                    tenant="alice")
        assert loop.abort("victim", tenant="mallory").result(timeout=5) is None
        assert loop.abort("victim", tenant="alice").result(timeout=5) is not None
        assert collect(q)[-1].finish_reason == "abort"
    finally:
        loop.shutdown(drain=False)


def test_engine_thread_takes_its_nice_value_from_the_environment(monkeypatch):
    """TRITON_LLM_ENGINE_NICE sets the nice value of the thread that applies it (the engine thread;
    the engine stub's default is -19, backend/serving/tritonserver.py); a value the process may not
    set is ignored. Raising it (here +3 over the current) is always allowed."""
    import os
    import threading

    from backend.engine import engine_loop as el
    from backend.serving.tritonserver import STUB_ENV_DEFAULTS

    assert STUB_ENV_DEFAULTS[el.ENGINE_NICE_ENV] == "-19"
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = {}

    def run(value: str) -> None:
        monkeypatch.setenv(el.ENGINE_NICE_ENV, value)
        el._apply_engine_nice()
        seen[value] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    for value in (str(min(base + 3, 19)), "not-a-number"):
        t = threading.Thread(target=run, args=(value,))
        t.start()
        t.join()
    assert seen[str(min(base + 3, 19))] == min(base + 3, 19)
    assert seen["not-a-number"] == base                   # a new thread keeps the creator's value
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base   # this thread untouched
