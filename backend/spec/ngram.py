"""Prompt lookup: propose the tokens that followed the last earlier occurrence of the sequence's
own suffix (an n-gram over prompt + output). No model, no state.

vLLM's knobs: ``prompt_lookup_max`` / ``prompt_lookup_min`` bound the n-gram length n; the
longest n in [min, max] whose suffix occurred before wins, and the proposal is the (up to k)
tokens after that occurrence. Of several occurrences the most recent one followed by k tokens is
used (in edits and quoting chats the text most recently seen is the likeliest to be copied
again), else the earliest, which has the longest continuation (a loop in the output)::

    tokens   a b c d x y a b c e f a b c | ?      suffix "a b c" (n = 3), k = 2
    matches  ^0          ^6                       most recent with 2 after: 6 -> propose  e f
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from backend.spec.proposer import Draft, Proposer

if TYPE_CHECKING:
    from backend.engine.sequence import Sequence


def find_continuation(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens after an earlier occurrence of the longest suffix n-gram (module doc)."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n:]
        # windows starting at 0 .. L-n-1: each must be followed by at least one token
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:L - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            full = hits[hits + n + k <= L]
            start = int(full[-1] if len(full) else hits[0]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer(Proposer):
    method = "ngram"

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max

    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> list[Draft]:
        return [Draft(find_continuation(np.asarray(s.token_ids, dtype=np.int64), self.n_min, self.n_max, k))
                for s, k in zip(seqs, max_drafts)]
