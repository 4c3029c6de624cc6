"""A short, bounded headless Locust run against the real stack (tritonserver + shim): both user
kinds stream, record TTFT and inter-token latency as their own entries, and nothing fails."""
from __future__ import annotations

import csv
import pathlib
import subprocess
import sys

import pytest

from tests.e2e.shim_fixtures import KEY, shim  # noqa: F401 -- fixture

pytestmark = pytest.mark.e2e
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_headless_locust_run_has_no_failures(triton_server, shim, tmp_path):  # noqa: F811
    prefix = tmp_path / "locust"
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "load" / "locustfile.py"), "--headless",
           "-u", "4", "-r", "4", "-t", "15s", "--stop-timeout", "30", "--only-summary",
           "--host", shim.url, "--triton-grpc", triton_server.grpc_url, "--api-key", KEY,
           "--max-tokens", "12", "--prompt-tokens", "24", "--csv", str(prefix)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
    log = (proc.stdout + proc.stderr)[-4000:]
    with open(f"{prefix}_stats.csv") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    assert proc.returncode == 0, log
    assert int(rows[("", "Aggregated")]["Failure Count"]) == 0, log
    for key in [("SSE", "time_to_first_token"), ("SSE", "inter_token_latency"), ("SSE", "end_to_end"),
                ("gRPC", "time_to_first_token"), ("gRPC", "inter_token_latency"), ("gRPC", "end_to_end"),
                ("POST", "/v1/chat/completions (stream)")]:
        assert key in rows, f"no Locust entry {key}: {sorted(rows)}"
        assert int(rows[key]["Request Count"]) > 0 and int(rows[key]["Failure Count"]) == 0, key
    # each stream yields one TTFT and at most (max_tokens - 1) gaps
    ttft, itl = (int(rows[("gRPC", n)]["Request Count"]) for n in ("time_to_first_token", "inter_token_latency"))
    assert 0 < itl <= 11 * ttft             # merged deltas (a slow reader) make fewer gaps
    assert float(rows[("SSE", "time_to_first_token")]["Median Response Time"]) > 0
