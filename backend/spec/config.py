"""SpeculativeConfig: the ``speculative_config`` engine option, in vLLM's spelling.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": "/path/to/small/checkpoint", "num_speculative_tokens": 4}

Given as a dict (``LLM(..., speculative_config={...})``) or as its JSON text (a Triton parameter,
``serve --engine-option speculative_config='{...}'``). As in vLLM, a missing ``method`` with a
``model`` means ``draft_model``, and the n-gram window defaults to 5..5 when neither bound is set
(one bound given: the other equals it). ``disable_by_batch_size`` (vLLM's name) is the back-off:
no speculation while that many sequences run, because a batch that large is no longer limited
by reading the weights, so extra query tokens stop being free. ``min_accepted_tokens`` (ours, not
vLLM's) sets the per-sequence back-off: see backend/spec/speculator.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    model: str | None = None                 # draft_model: a checkpoint with the target's tokenizer
    disable_by_batch_size: int = 8           # back-off: plain decoding at >= this many running
    min_accepted_tokens: float | None = None  # per-sequence back-off threshold; None = measured (speculator.py)

    @classmethod
    def parse(cls, value: Any) -> "SpeculativeConfig | None":
        """dict / JSON text / None / "" -> a validated config (ValueError naming the bad key)."""
        if value is None or value == "" or isinstance(value, SpeculativeConfig):
            return value or None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object")
        d = dict(value)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if d.get("method") is None and d.get("model"):
            d["method"] = "draft_model"
        if d.get("method") not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {d.get('method')!r}")
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5
        d["prompt_lookup_min"] = hi if lo is None else lo
        d["prompt_lookup_max"] = lo if hi is None else hi
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            if key in d and (not isinstance(d[key], int) or isinstance(d[key], bool) or d[key] < 1):
                raise ValueError(f"speculative_config.{key} must be a positive integer, got {d[key]!r}")
        m = d.get("min_accepted_tokens")
        if m is not None and (not isinstance(m, (int, float)) or isinstance(m, bool) or not 0 <= m <= 32):
            raise ValueError(f"speculative_config.min_accepted_tokens must be a number in [0, 32], got {m!r}")
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        if d["num_speculative_tokens"] > 32:
            raise ValueError("speculative_config.num_speculative_tokens must be at most 32")
        if d["prompt_lookup_min"] > d["prompt_lookup_max"]:
            raise ValueError("speculative_config.prompt_lookup_min must be <= prompt_lookup_max")
        if d["method"] == "draft_model" and not d.get("model"):
            raise ValueError("speculative_config.model (a checkpoint directory) is required for draft_model")
        return cls(**d)
