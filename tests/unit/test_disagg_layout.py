"""The CPU layout of the disaggregated pair (backend/serving/disagg_layout.py apply_layout), on real
process trees standing in for the two tritonservers (a root process with one child = its stub)."""
import os
import subprocess
import sys
import time
import types

import pytest

from backend.serving.disagg_layout import _children, apply_layout, parse_cpus, sched_tree, tree_tids

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")

# a "server": a root that starts a child ("stub") and both sleep
TREE = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "time.sleep(60)")


@pytest.fixture
def pair():
    procs = [subprocess.Popen([sys.executable, "-c", TREE], start_new_session=True) for _ in range(2)]
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 20
        while not all(_children(p.pid) for p in procs):
            assert time.monotonic() < deadline, "the stand-in stubs did not start"
            time.sleep(0.05)
        servers = [types.SimpleNamespace(proc=p) for p in procs]
        yield types.SimpleNamespace(servers=servers, prefill=servers[0], decode=servers[1]), other.pid
    finally:
        for p in procs:
            for c in _children(p.pid):
                os.kill(c, 9)
            p.kill()
            p.wait()
        other.kill()
        other.wait()


def _state(pid, *, root):
    tids = tree_tids(pid, include_root=root, descendants=not root)
    assert tids
    return {(frozenset(os.sched_getaffinity(t)), os.sched_getscheduler(t), os.getpriority(os.PRIO_PROCESS, t))
            for t in tids}


def test_the_decode_engine_runs_alone_and_the_prefill_engine_yields(pair):
    pair, other = pair
    cpus = ({0}, {1})
    pre, dec = pair.prefill.proc.pid, pair.decode.proc.pid
    root = os.geteuid() == 0            # a negative nice needs CAP_SYS_NICE (skipped without it)
    hi = -10 if root else 0
    for _ in range(2):                  # re-placing gives the same state (each first resets all)
        apply_layout(pair, cpus, others=(other,))
        assert _state(dec, root=False) == {(frozenset({1}), os.SCHED_OTHER, hi)}      # decode engine
        assert _state(dec, root=True) == {(frozenset({0}), os.SCHED_OTHER, hi)}       # its front end
        assert _state(pre, root=True) == {(frozenset({0}), os.SCHED_OTHER, hi)}
        assert _state(other, root=True) == {(frozenset({0}), os.SCHED_OTHER, hi)}     # shim / bench client
        assert _state(pre, root=False) == {(frozenset({0}), os.SCHED_BATCH, 19)}    # prefill engine yields


def test_cpu_specs():
    assert parse_cpus("0:1") == ({0}, {1})
    assert parse_cpus("0-1:2,3") == ({0, 1}, {2, 3})
    assert parse_cpus("none") is None and parse_cpus(None) is None
    mine = sorted(os.sched_getaffinity(0))
    pre, dec = parse_cpus("auto")
    assert pre | dec == set(mine) and not pre & dec and max(pre) < min(dec)
    with pytest.raises(ValueError, match="PREFILL:DECODE"):
        parse_cpus("0,1")


def test_sched_tree_skips_what_it_may_not_do():
    # nice back to 0 from 19 / below 0 need CAP_SYS_NICE; without it the calls must not raise
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert sched_tree(p.pid, nice=19, policy=os.SCHED_BATCH) >= 1
        assert os.getpriority(os.PRIO_PROCESS, p.pid) == 19
        sched_tree(p.pid, nice=-5)
        sched_tree(p.pid)
    finally:
        p.kill()
        p.wait()
