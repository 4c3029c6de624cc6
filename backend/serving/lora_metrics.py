"""``AdapterMetrics``: the per-adapter series of multi-LoRA serving (docs/lora.md), labelled
``lora=<name>``, written by the metrics thread (backend/serving/metrics.py): requests and tokens
sent from the response thread's ``AdapterUse`` events, summed per batch, and the registry's loads
and evictions as the changes since the last poll. A series is made when its adapter is first
used (adapters are loaded at run time; the names are bounded by what the admins load)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True, slots=True)
class AdapterUse:
    """A request on LoRA adapter ``lora`` was admitted (``requests``) or sent ``tokens`` generated tokens."""
    lora: str
    requests: int = 0
    tokens: int = 0


class AdapterMetrics:
    """Metrics thread only. ``counts``: the LoRA registry's per-adapter (loads, evictions)
    (LoRARegistry.counts)."""

    def __init__(self, factory: Any, labels: dict[str, str], counts: Callable[[], dict[str, tuple[int, int]]]) -> None:
        self._factory, self._labels, self._counts = factory, labels, counts
        self._series: dict[str, dict[str, Any]] = {}         # adapter -> its series
        self._last: dict[str, tuple[int, int]] = {}

    def series(self, name: str) -> dict[str, Any]:
        series = self._series.get(name)
        if series is None:
            lab = {**self._labels, "lora": name}
            f = self._factory
            series = self._series[name] = {
                "requests": f.counter("llm_lora_requests_total", "Requests on a LoRA adapter (counted at their first scheduled step)", lab),
                "tokens": f.counter("llm_lora_generation_tokens_total",
                                    "Generated tokens sent for requests on a LoRA adapter", lab),
                "loads": f.counter("llm_lora_loads_total",
                                   "LoRA adapter reads into the resident pool (at start, load route, after eviction)",
                                   lab),
                "evictions": f.counter("llm_lora_evictions_total",
                                       "LoRA adapters evicted from the resident pool (max_loras)", lab)}
        return series

    def used(self, requests: Counter, tokens: Counter) -> None:
        """One batch's requests and tokens per adapter: one increment each."""
        for name in requests:
            series = self.series(name)
            for key, n in (("requests", requests[name]), ("tokens", tokens[name])):
                if n:
                    series[key].increment(n)

    def poll(self) -> None:
        for name, (loads, evictions) in self._counts().items():
            last_loads, last_evictions = self._last.get(name, (0, 0))
            if (loads, evictions) == (last_loads, last_evictions):
                continue
            series = self.series(name)
            if loads > last_loads:
                series["loads"].increment(loads - last_loads)
            if evictions > last_evictions:
                series["evictions"].increment(evictions - last_evictions)
            self._last[name] = (loads, evictions)
