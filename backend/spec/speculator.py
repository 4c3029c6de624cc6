"""Speculator: which sequences speculate this step, and how many draft tokens each may carry.

Called by the engine once per step before ``schedule()``. A sequence speculates when it is
decoding (only its last token lacks KV), belongs to a request that is already forked (n > 1
choices exist) and did not opt out (``SamplingParams.speculative``). The draft count is capped
so every drafted token could be kept: ``max_tokens`` left minus one and the context window.
Nothing speculates while ``disable_by_batch_size`` or more sequences run (the back-off).
The scheduler may still drop drafts that do not fit the step's token budget or the KV pool.
"""
from __future__ import annotations

from typing import Iterable

from backend.engine.sequence import Sequence
from backend.spec.config import SpeculativeConfig
from backend.spec.proposer import Proposer


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int):
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len

    @property
    def method(self) -> str:
        return self.proposer.method

    def propose(self, running: Iterable[Sequence]) -> None:
        """Set ``spec_token_ids`` / ``spec_probs`` of the running sequences for this step."""
        running = list(running)
        self.proposer.release(running)
        for seq in running:
            seq.spec_token_ids, seq.spec_probs = [], None
        if len(running) >= self.config.disable_by_batch_size:
            return
        seqs, limits = [], []
        for seq in running:
            k = self._max_drafts(seq)
            if k > 0:
                seqs.append(seq)
                limits.append(k)
        if not seqs:
            return
        for seq, draft in zip(seqs, self.proposer.propose(seqs, limits)):
            seq.spec_token_ids = list(draft.token_ids)
            seq.spec_probs = draft.probs if draft.token_ids else None

    def release(self, running: Iterable[Sequence]) -> None:
        self.proposer.release(running)

    def _max_drafts(self, seq: Sequence) -> int:
        if seq.num_computed_tokens != seq.num_tokens - 1 or not seq.request.forked:
            return 0
        if not getattr(seq.params, "speculative", True):
            return 0
        left = seq.request.max_tokens - seq.num_output_tokens - 1
        room = self.max_model_len - seq.num_tokens - 1
        return max(0, min(self.config.num_speculative_tokens, left, room))


def make_speculator(config: SpeculativeConfig | None, *, args, runner, max_model_len: int) -> Speculator | None:
    """The engine's speculator for ``config`` (None: speculation off)."""
    if config is None:
        return None
    if config.method == "ngram":
        from backend.spec.ngram import NgramProposer
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    else:
        from backend.spec.draft_model import DraftModelProposer
        proposer = DraftModelProposer(config.model, args, num_blocks=runner.num_blocks,
                                      vocab_size=runner.info.vocab_size)
    return Speculator(config, proposer, max_model_len)
