"""The first-token trace (bench/ttft_trace.py): the product's hook is empty unless the lab attaches
it (bench/lab_venv.py, tests/bench/test_lab_venv.py); the trace's report joins the processes' marks
per request id and gives the median gap between consecutive hops."""
from __future__ import annotations

import json

from backend import timing
from bench import ttft_trace


def test_the_product_has_no_hook_and_a_mark_records_nothing():
    assert timing.hook is None
    n = len(ttft_trace._buf)
    timing.mark("r", "eng.exec")
    assert len(ttft_trace._buf) == n


def test_report_joins_processes_per_request(tmp_path):
    # two processes' files; request b misses the preprocessing hop (a direct engine call)
    (tmp_path / "shim-1.jsonl").write_text("\n".join(json.dumps(r) for r in [
        ("a", "shim.recv", 10.000), ("a", "shim.sse0", 10.010), ("b", "shim.recv", 20.000),
        ("b", "shim.sse0", 20.004)]) + "\n")
    (tmp_path / "stub-2.jsonl").write_text("\n".join(json.dumps(r) for r in [
        ("a", "pre.exec", 10.001), ("a", "eng.exec", 10.002), ("a", "rt.send0", 10.008),
        ("a", "rt.send0", 10.020),                      # a later send: the first one counts
        ("b", "eng.exec", 20.001), ("b", "rt.send0", 20.003)]) + "\n")
    events = ttft_trace.load(tmp_path)
    assert events["a"]["rt.send0"] == 10.008
    text = ttft_trace.report(tmp_path)
    assert "2 requests" in text
    lines = {tuple(line.split()[:3]): line for line in text.splitlines()[1:]}
    assert float(lines[("eng.exec", "->", "rt.send0")].split()[3]) == 4.0     # median of 6 and 2 ms
    assert float(lines[("shim.recv", "->", "pre.exec")].split()[3]) == 1.0    # request a only
