"""The decode-step trace (backend/disagg/trace.py): records written by a real StepTrace, joined
with client arrivals into the engine / delivery split of each token's inter-token latency."""
import gc
import json
from types import SimpleNamespace

from backend.disagg.trace import StepTrace, _itl, _per_token, report


def _delta(rid, n):
    return SimpleNamespace(request_id=rid, new_token_ids=[1] * n)


def test_per_token_and_itl_spread_a_coalesced_response():
    toks = _per_token([("a", 1, 0.0), ("a", 1, 0.01), ("a", 2, 0.04), ("b", 1, 0.02)])
    assert toks == {("a", 0): 0.0, ("a", 1): 0.01, ("a", 2): 0.04, ("a", 3): 0.04, ("b", 0): 0.02}
    itl = _itl(toks)
    assert set(itl) == {("a", 1), ("a", 2), ("a", 3)}          # no gap before a first token
    assert abs(itl[("a", 1)] - 0.01) < 1e-12
    assert abs(itl[("a", 2)] - 0.015) < 1e-12 and abs(itl[("a", 3)] - 0.015) < 1e-12


def test_report_splits_engine_cadence_from_delivery(tmp_path):
    tr = StepTrace(tmp_path, every=3600)
    try:
        # 20 steps of 10 ms, two streams; one token of "s-1" reaches the client 8 ms late
        for i in range(20):
            t0 = 100 + i * 0.01
            tr.step(t0, t0, t0 + 0.009, 2, 0, [_delta("s-0", 1), _delta("s-1", 1), _delta("x", 0)])
        gc.collect()
    finally:
        tr.close()
    lines = [json.loads(x) for x in tr.path.read_text().splitlines()]
    assert sum(r["k"] == "step" for r in lines) == 20
    assert any(r["k"] == "gc" and r["gen"] == 2 for r in lines)          # the collection above
    arrivals = []
    for i in range(20):
        t = 100 + i * 0.01 + 0.009 + 0.001
        arrivals += [{"rid": "s-0", "n": 1, "t": t},
                     {"rid": "s-1", "n": 1, "t": t + (0.008 if i == 10 else 0.0)}]
    (tmp_path / "client-0.jsonl").write_text("".join(json.dumps(a) + "\n" for a in arrivals))
    r = report(tmp_path, prefix="s-")
    assert r["tokens"] == 38                                 # 2 x 19 gaps
    assert abs(r["engine_itl_p99"] - 0.01) < 1e-6           # the engine kept its cadence
    assert r["client_itl_p99"] > 0.017                       # the late token: 18 ms at the client
    assert abs(r["delivery_p50"] - 0.001) < 1e-6 and abs(r["delivery_max"] - 0.009) < 1e-6
    assert r["tail_tokens"] >= 1 and r["tail_with_slow_engine"] == 0
    assert r["steps"] == 20 and abs(r["cadence_p50"] - 0.01) < 1e-6
    # the late token's 18 ms = 10 ms of engine cadence + 8 ms of its place in its step's sends
    # (that step's first token, s-0's, was on time)
    assert r["tail_mean_client_itl"] > 0.017 and abs(r["tail_mean_engine_itl"] - 0.01) < 1e-6
    assert abs(r["tail_mean_first_lag_diff"]) < 1e-9 and abs(r["tail_mean_position_diff"] - 0.008) < 1e-6


def test_the_trace_records_each_send_of_the_response_path(tmp_path):
    from backend.serving import response_thread as R
    from backend.serving.messages import RequestHandle

    class Responder:
        def __init__(self):
            self.sent = 0

        def send(self, outputs=None, *, error=None, final=False):
            self.sent += 1

    tr = StepTrace(tmp_path)
    try:
        tr.time_sends()
        h = RequestHandle("s0-0", Responder(), arrival=0.0)
        for _ in range(3):
            R._send_one(h, {}, None, False)
        tr.step(1.0, 1.0, 1.001, 1, 0, [])
    finally:
        R.SEND_TIMES = None
        tr.close()
    r = report(tmp_path)
    assert h.responder.sent == 3 and r["sends"] == 3 and r["send_p99"] >= r["send_p50"] >= 0.0
