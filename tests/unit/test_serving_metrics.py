"""The metrics thread applies one batch of events with one increment per counter label."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from backend.serving.metrics import Finished, Observe, Rejected, ServingMetrics


class Metric:
    def __init__(self, name, labels):
        self.name, self.labels, self.calls = name, labels, []

    def increment(self, n):
        self.calls.append(("increment", n))

    def set(self, v):
        self.calls.append(("set", v))

    def observe(self, v):
        self.calls.append(("observe", v))


class Factory:
    def __init__(self):
        self.metrics: list[Metric] = []

    def _make(self, name, labels):
        self.metrics.append(Metric(name, labels))
        return self.metrics[-1]

    def counter(self, name, doc, labels):
        return self._make(name, labels)

    gauge = counter

    def histogram(self, name, doc, labels, buckets):
        return self._make(name, labels)

    def get(self, name, **labels):
        (m,) = [m for m in self.metrics if m.name == name and all(m.labels.get(k) == v for k, v in labels.items())]
        return m


def stats():
    kv = SimpleNamespace(prefix_queried_tokens=0, prefix_hit_tokens=0, evictions=0, offload_out_bytes=0,
                         offload_in_bytes=0)
    return SimpleNamespace(num_running=0, num_waiting=0, kv_usage=0.0, prompt_tokens=0, generation_tokens=0,
                           num_preemptions=0, num_aborted=0, num_deadline_exceeded=0, kv=kv)


def test_a_batch_is_one_increment_per_label():
    f = Factory()
    m = ServingMetrics(f, stats=stats, healthy=lambda: True, labels={"model": "engine"}, poll_interval=60)
    try:
        m.record([Finished("length"), Observe("llm_queue_time_seconds", 0.5), Finished("length"),
                  Rejected("queue_full"), Finished("stop"), Finished("length"), Rejected("nonsense"),
                  Observe("llm_queue_time_seconds", -1.0)])
        m.flush()
        assert f.get("llm_requests_finished_total", reason="length").calls == [("increment", 3)]
        assert f.get("llm_requests_finished_total", reason="stop").calls == [("increment", 1)]
        assert f.get("llm_requests_finished_total", reason="abort").calls == []
        assert f.get("llm_requests_rejected_total", reason="queue_full").calls == [("increment", 1)]
        assert f.get("llm_requests_rejected_total", reason="internal").calls == [("increment", 1)]
        assert f.get("llm_queue_time_seconds").calls == [("observe", 0.5), ("observe", 0.0)]
    finally:
        m.stop()


def test_token_counters_are_polled_at_the_interval_not_per_batch():
    """The token counters change every step; each write is an IPC on the real server: batches of
    events leave them alone (only the request gauges are polled per batch), a flush writes them."""
    f = Factory()
    calls = []

    def growing_stats():                    # every poll sees more generated tokens and more running
        calls.append(1)
        s = stats()
        s.generation_tokens = s.num_running = len(calls)
        return s

    m = ServingMetrics(f, stats=growing_stats, healthy=lambda: True, labels={"model": "engine"},
                       poll_interval=60)
    try:
        for _ in range(20):
            m.record([Observe("llm_inter_token_latency_seconds", 0.01)])
        m.flush()
        assert f.get("llm_inter_token_latency_seconds_count").calls == [("set", 20.0)]
        assert f.get("llm_generation_tokens_total").calls == [("increment", float(len(calls)))]
        assert f.get("llm_num_requests_running").calls[-1] == ("set", float(len(calls)))
    finally:
        m.stop()


def test_inter_token_latency_is_counted_locally_and_written_at_the_poll():
    """No IPC per response: the ITL histogram's observations become bucket counts written at the
    poll as Prometheus's histogram series (cumulative buckets with le, sum, count), changed ones only."""
    f = Factory()
    m = ServingMetrics(f, stats=stats, healthy=lambda: True, labels={"model": "engine"}, poll_interval=60)
    name = "llm_inter_token_latency_seconds"
    try:
        m.record([Observe(name, v) for v in (0.0005, 0.003, 0.003, 0.02, 99.0)])
        m.record([Observe(name, 0.001)])             # on a bound: counted in that bucket (le)
        assert all(not x.calls for x in f.metrics if x.name.startswith(name))     # nothing written yet
        m.flush()

        def bucket(le):
            return f.get(f"{name}_bucket", le=le).calls[-1][1]
        assert [bucket(le) for le in ("0.001", "0.0025", "0.005", "0.01", "0.025", "10", "+Inf")] == \
            [2, 2, 4, 4, 5, 5, 6]
        assert f.get(f"{name}_count").calls == [("set", 6.0)]
        assert f.get(f"{name}_sum").calls[-1][1] == pytest.approx(0.0005 + 0.006 + 0.02 + 99 + 0.001)
        m.record([Observe(name, 0.002)])
        m.flush()                                    # only the changes: one more in le >= 0.0025
        assert f.get(f"{name}_count").calls[-1] == ("set", 7.0)
        assert len(f.get(f"{name}_bucket", le="0.001").calls) == 1          # unchanged: not written
        assert bucket("0.001") == 2 and bucket("0.0025") == 3 and bucket("+Inf") == 7
    finally:
        m.stop()
