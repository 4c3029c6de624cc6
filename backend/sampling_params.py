"""SamplingParams: per-request generation settings, OpenAI names, validated at construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from backend.errors import InvalidSamplingParam

__all__ = ["InvalidSamplingParam", "SamplingParams"]


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16          # None = the rest of the context window
    min_tokens: int = 0
    temperature: float = 1.0             # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                       # 0 or -1 = disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None          # number of top logprobs per token (0 = only the chosen)
    skip_special_tokens: bool = True
    speculative: bool = True             # False: this request never carries draft tokens (opt-out)
    # Structured outputs (backend/structured): a StructuredSpec (JSON schema, regex, choice, grammar,
    # tool calls) and OpenAI's logit_bias {token id: bias in [-100, 100]}.
    structured: Any = None
    logit_bias: dict[int, float] | None = None
    lora: str | None = None              # a LoRA adapter's name (backend/lora); None = the base model

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise InvalidSamplingParam(name, f"{name} {why}")

        def finite(name: str, v: float) -> None:
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                bad(name, f"must be a finite number, got {v!r}")

        if not isinstance(self.n, int) or self.n < 1 or self.n > 16:
            bad("n", f"must be an integer in [1, 16], got {self.n!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"must be a non-negative integer, got {self.min_tokens!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            finite(name, getattr(self, name))
        if self.temperature < 0 or self.temperature > 100:
            bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be -1, 0 or a positive integer, got {self.top_k!r}")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not 0 < self.repetition_penalty <= 2:
            bad("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        if len(self.stop) > 4 or any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be at most 4 non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora or len(self.lora) > 128):
            bad("lora", f"must be an adapter name (1 to 128 characters), got {self.lora!r}")
        if self.constrained:
            from backend.structured.spec import check_structured
            self.logit_bias = check_structured(self.structured, self.logit_bias)

    @property
    def constrained(self) -> bool:
        """The one check of whether structured-output work applies (a spec or a logit_bias):
        requests without either never enter backend/structured."""
        return self.structured is not None or bool(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
