"""Speculator: which sequences speculate this step, and how many draft tokens each may carry.

Called by the engine once per step before ``schedule()``. A sequence speculates when it is
decoding (only its last token lacks KV), belongs to a request that is already forked (n > 1
choices exist) and did not opt out (``SamplingParams.speculative``). The draft count is capped
so every drafted token could be kept: ``max_tokens`` left minus one and the context window.
Nothing speculates while ``disable_by_batch_size`` or more sequences run (the batch back-off).
The scheduler may still drop drafts that do not fit the step's token budget or the KV pool.

The per-sequence back-off: a verification step costs more than a plain decode (on CPU the
matmuls of k + 1 rows cost a few single-row ones), so drafting only pays while enough drafts are
accepted: a step that costs r times a plain one must accept more than r - 1 drafts. The engine
reports the model time of pure-decode steps with and without drafts (``observe``), and r is the
ratio of their moving averages (``min_accepted_tokens`` fixes the threshold instead). Each
choice keeps a moving average of accepted drafts per verification step; below the threshold it
stops drafting for 2, 4, 8 ... (at most 64) steps, then probes again.
Free-form text that copies little thus decodes plainly; a stretch that starts copying is found
within a few steps. Whether a step speculates never changes what it outputs (verification is
exact), only how fast.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from backend.spec.config import SpeculativeConfig
from backend.spec.proposer import Proposer

if TYPE_CHECKING:
    from backend.engine.sequence import Sequence


@dataclass
class _Policy:
    ema: float                      # accepted drafts per verification step (moving average)
    seen_steps: int = 0             # seq.num_spec_steps / num_accepted already folded in
    seen_accepted: int = 0
    backoff: int = 1                # next pause length (steps), doubled per bad verification
    wait: int = 0                   # steps left in the current pause


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int):
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self._step_time = {False: None, True: None}    # moving average, decode steps without/with drafts

    def observe(self, with_drafts: bool, seconds: float) -> None:
        """Model time of a step that only decoded (no prompt chunk in it)."""
        old = self._step_time[with_drafts]
        self._step_time[with_drafts] = seconds if old is None else 0.8 * old + 0.2 * seconds

    @property
    def threshold(self) -> float:
        """Accepted drafts per verification below which a sequence backs off."""
        if self.config.min_accepted_tokens is not None:
            return self.config.min_accepted_tokens
        plain, spec = self._step_time[False], self._step_time[True]
        if plain is None or spec is None:
            return 1.0
        return min(float(self.config.num_speculative_tokens), max(0.25, spec / plain - 1.0))

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
            if k > 0 and self._worth_it(seq):
                seqs.append(seq)
                limits.append(k)
        if not seqs:
            return
        for seq, draft in zip(seqs, self.proposer.propose(seqs, limits)):
            seq.spec_token_ids = list(draft.token_ids)
            seq.spec_probs = draft.probs if draft.token_ids else None

    def release(self, running: Iterable[Sequence]) -> None:
        self.proposer.release(running)

    def _worth_it(self, seq: Sequence) -> bool:
        """The per-sequence back-off (module doc): update from the last verification, decide."""
        threshold = self.threshold
        pol = seq.spec_policy
        if pol is None:
            pol = seq.spec_policy = _Policy(ema=float(self.config.num_speculative_tokens))
        if seq.num_spec_steps > pol.seen_steps:
            accepted = (seq.num_accepted - pol.seen_accepted) / (seq.num_spec_steps - pol.seen_steps)
            pol.ema = 0.5 * pol.ema + 0.5 * accepted
            pol.seen_steps, pol.seen_accepted = seq.num_spec_steps, seq.num_accepted
            if pol.ema >= threshold:
                pol.backoff = 1
            else:
                pol.backoff = min(64, pol.backoff * 2)
                pol.wait = pol.backoff
        if pol.wait > 0:
            pol.wait -= 1
            if pol.wait == 0:              # probe once: one good verification brings it back
                pol.ema = threshold
            return pol.wait == 0
        return True

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
