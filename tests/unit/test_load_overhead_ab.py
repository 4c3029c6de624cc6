"""load/overhead_ab.py's table and contender labels (the benchmark itself needs a server)."""
from __future__ import annotations

import os

import pytest

from load.overhead_ab import process_stats, split_contender, table


def row(name, rnd, tok_s, cpu):
    return dict(contender=name, concurrency=32, round=rnd, tok_s=tok_s, itl_p50_ms=1.0, cpu_ms_per_token=cpu)


def test_table_pairs_each_round_with_the_engine_of_the_same_round():
    results = [row("engine", 1, 1000, 1.2), row("engine", 2, 500, 1.3), row("engine", 3, 900, 1.25),
               row("http@tree=/tmp/b", 1, 700, 2.4), row("http@tree=/tmp/b", 2, 400, 2.5),
               row("http@tree=/tmp/b", 3, 630, 2.6)]
    lines = table(results, ["engine", "http@tree=/tmp/b"]).splitlines()
    assert lines[2] == "| 32 | engine | 1000 | 100% / 100% | 1.00 | 1.20 |"
    # best 700 / best 1000 = 70 %; per round 70 %, 80 %, 70 % -> median 70 %
    assert lines[3] == "| 32 | http@tree=/tmp/b | 700 | 70% / 70% | 1.00 | 2.40 |"


def test_contender_labels_carry_engine_options_and_a_tree():
    assert split_contender("http@busy_stream_interval=0.1@tree=/tmp/base") == \
        ("http", {"busy_stream_interval": "0.1", "tree": "/tmp/base"})
    with pytest.raises(ValueError, match="unknown contender"):
        split_contender("https")


def test_process_stats_sums_each_processes_threads_per_token():
    """Threads of one process add up under its label (this process: its command line), busiest
    first; a thread that appeared during the point counts from zero."""
    me = os.getpid()
    before = {(me, 1): (10.0, 0.0, 0, 0), (me, 2): (4.0, 0.0, 0, 0), (2 ** 22 + 7, 3): (0.0, 0.0, 0, 0)}
    after = {(me, 1): (30.0, 1.0, 5, 5), (me, 2): (6.0, 0.0, 1, 1), (me, 4): (8.0, 0.0, 1, 1),
             (2 ** 22 + 7, 3): (50.0, 0.0, 0, 0)}
    per = process_stats(before, after, tokens=10)
    names = list(per)
    assert per[names[1]] == pytest.approx((20 + 2 + 8) / 10)     # this process: three threads
    assert names[0] == f"pid {2 ** 22 + 7}" and per[names[0]] == pytest.approx(5.0)   # gone: by pid
