"""The first-token trace (bench/ttft_trace.py): the engine loop's hook is None unless the lab sets
it (bench/lab_venv.py, tests/bench/test_lab_venv.py); the trace's report joins the processes' marks
per request id and gives the median gap between consecutive events."""
from __future__ import annotations

import json

from backend.engine import engine_loop
from bench import ttft_trace


def test_the_product_sets_no_hook():
    assert engine_loop.trace is None


def test_report_joins_processes_per_request(tmp_path):
    # two processes' files; request b has no client events (a direct engine call)
    (tmp_path / "client-1.jsonl").write_text("\n".join(json.dumps(r) for r in [
        ("a", "client.send", 10.000), ("a", "client.tok0", 10.010)]) + "\n")
    (tmp_path / "stub-2.jsonl").write_text("\n".join(json.dumps(r) for r in [
        ("a", "loop.add", 10.001), ("a", "loop.step0", 10.002), ("a", "loop.tok0", 10.008),
        ("a", "loop.tok0", 10.020),                     # a later step: the first one counts
        ("b", "loop.step0", 20.001), ("b", "loop.tok0", 20.003)]) + "\n")
    events = ttft_trace.load(tmp_path)
    assert events["a"]["loop.tok0"] == 10.008
    text = ttft_trace.report(tmp_path)
    assert "2 requests" in text
    lines = {tuple(line.split()[:3]): line for line in text.splitlines()[1:]}
    assert float(lines[("loop.step0", "->", "loop.tok0")].split()[3]) == 4.0   # median of 6 and 2 ms
    assert float(lines[("client.send", "->", "loop.add")].split()[3]) == 1.0   # request a only
