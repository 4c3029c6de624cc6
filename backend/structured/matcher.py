"""GrammarState: one choice's position in its grammar (an xgrammar ``GrammarMatcher``).

Created with the choice (``Sequence.grammar``; n > 1 choices each get their own), advanced by
every token appended to the choice (``Scheduler._append`` calls :meth:`advance`, accepted
speculative drafts included, one by one), dropped with it. Preemption needs nothing: the state
follows the output tokens, which a recompute keeps. The mask for the next token comes from
:meth:`fill` (logits.py fills the whole batch's bitmask).

When the grammar has ended (the matcher accepted a stop token after a complete value) the choice
finishes with "stop", also with ``ignore_eos``.
"""
from __future__ import annotations

import torch

from backend.errors import internal


class GrammarState:
    def __init__(self, grammar):
        import xgrammar as xgr
        self.grammar = grammar
        self.matcher = xgr.GrammarMatcher(grammar.compiled)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-next-token bits into ``bitmask[row]``."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(int(token))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)

    def advance(self, seq, token: int) -> None:
        """``token`` was appended to ``seq``: move past it; finish the choice when the grammar
        ended. A token the grammar refuses cannot come from the masked sampler, so it is an
        internal error that ends only this choice."""
        if self.terminated:
            return
        if not self.accept(token):
            if seq.finish_reason is None:
                seq.finish_reason = "error"
                seq.error = internal(f"the sampled token {token} breaks the output grammar")
            return
        if self.terminated and seq.finish_reason is None:
            seq.finish_reason = "stop"
            seq.cut_last_token = True          # the stop token that ended the grammar is not text
