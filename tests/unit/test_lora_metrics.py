"""Per-adapter metrics: the response thread's recorder counts a request once (at its first delta,
whatever its n) and every token sent, per adapter; the metrics thread writes one increment per
adapter and batch, and the registry's loads and evictions (a real LoRARegistry, one slot for two
adapters) as the changes since the last poll."""
from __future__ import annotations

import pytest

from backend.lora.registry import LoRARegistry
from backend.model.config import load_model_config
from backend.outputs import StepDelta
from backend.serving.lora_metrics import AdapterUse
from backend.serving.intake import RequestHandle
from backend.serving.metrics import LatencyRecorder, ServingMetrics
from tests.conftest import model_dir
from tests.unit.lora_helpers import make_adapter
from tests.unit.test_serving_metrics import Factory, stats


class Sink:
    def __init__(self):
        self.events = []

    def record(self, events):
        self.events += events


def delta(index: int, tokens: list[int], finished: bool = False) -> StepDelta:
    return StepDelta("r", index, tokens, tokens, 0, finished=finished, completion_tokens=len(tokens))


def test_the_recorder_counts_requests_once_and_every_token_per_adapter():
    sink = Sink()
    rec = LatencyRecorder(sink)
    on_a = RequestHandle("r", None, arrival=0.0, remaining=2, lora="a")
    base = RequestHandle("s", None, arrival=0.0)
    for h, d in ((on_a, delta(0, [5, 6])), (on_a, delta(1, [7])), (base, delta(0, [1, 2, 3])),
                 (on_a, delta(0, [8], finished=True)), (on_a, delta(1, [], finished=True))):
        rec.delta(h, d, now=1.0)
    rec.flush()
    uses = [e for e in sink.events if isinstance(e, AdapterUse)]
    assert uses == [AdapterUse("a", requests=1, tokens=2), AdapterUse("a", tokens=1), AdapterUse("a", tokens=1)]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root, tiny = tmp_path_factory.mktemp("loras"), model_dir("tiny")
    return {"a": str(make_adapter(tiny, root / "a", 8, 16, ["q_proj"], 71)),
            "b": str(make_adapter(tiny, root / "b", 8, 16, ["v_proj"], 72))}


def test_adapter_series_are_written_per_batch_and_poll(adapters):
    reg = LoRARegistry(load_model_config(model_dir("tiny")), max_loras=1, max_lora_rank=8)
    reg.load("a", adapters["a"])
    reg.load("b", adapters["b"])                # one slot: a is evicted
    f = Factory()
    m = ServingMetrics(f, stats=stats, healthy=lambda: True, labels={"model": "engine"}, poll_interval=60,
                       adapters=reg.counts)
    try:
        m.record([AdapterUse("a", requests=1, tokens=3), AdapterUse("b", requests=1), AdapterUse("a", tokens=2)])
        m.flush()

        def calls(name, lora):
            return [n for _, n in f.get(name, lora=lora).calls]
        assert calls("llm_lora_requests_total", "a") == [1] and calls("llm_lora_generation_tokens_total", "a") == [5]
        assert calls("llm_lora_requests_total", "b") == [1] and calls("llm_lora_generation_tokens_total", "b") == []
        assert calls("llm_lora_loads_total", "a") == [1] and calls("llm_lora_evictions_total", "a") == [1]
        assert calls("llm_lora_loads_total", "b") == [1] and calls("llm_lora_evictions_total", "b") == []
        reg.resolve("a")                        # read again after its eviction; b goes
        m.flush()
        m.flush()                               # nothing changed since: nothing written
        assert calls("llm_lora_loads_total", "a") == [1, 1] and calls("llm_lora_evictions_total", "b") == [1]
        assert calls("llm_lora_evictions_total", "a") == [1] and calls("llm_lora_loads_total", "b") == [1]
        assert all(m_.labels["model"] == "engine" for m_ in f.metrics if m_.name.startswith("llm_lora_"))
    finally:
        m.stop()
