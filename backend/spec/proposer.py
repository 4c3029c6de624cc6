"""The proposer interface: what every speculative method (n-gram, draft model, later EAGLE-style
heads) provides to the engine.

Once per step, before scheduling, the engine's :class:`~backend.spec.speculator.Speculator` hands
a proposer the decoding sequences it may speculate for and an upper bound of draft tokens for
each; the proposer answers one :class:`Draft` per sequence. A proposer that keeps per-sequence
state (a draft model's KV cache) reconciles it itself: tokens of a sequence never change once
appended, so the state's valid part is the longest prefix that still matches ``seq.token_ids``;
``release`` drops the state of sequences that stopped running.

An EAGLE-style proposer fits the same shape: it needs the target's hidden states, which the
runner would return next to the logits; the verification (backend/spec/verify.py) is the same.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import torch

if TYPE_CHECKING:
    from backend.engine.sequence import Sequence



@dataclass
class Draft:
    """Proposed continuation of one sequence. ``probs[i]`` is the distribution ``token_ids[i]``
    was drawn from ([k, V] on the target's vocabulary); None means a deterministic proposal (a
    point mass: prompt lookup, a greedy draft), for which verification is plain sampling."""
    token_ids: list[int]
    probs: torch.Tensor | None = None


class Proposer(ABC):
    method: str = "base"

    @abstractmethod
    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> list[Draft]:
        """At most ``max_drafts[i]`` (>= 1) tokens for ``seqs[i]``, a decoding sequence whose
        next token is unknown; an empty Draft when there is nothing worth proposing."""

    def release(self, running: Iterable[Sequence]) -> None:
        """Forget every sequence not in ``running`` (finished, aborted, preempted)."""

    def check_idle(self) -> None:
        """Assert that no per-sequence resources remain (tests, the engine's idle audit)."""
