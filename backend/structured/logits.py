"""The batch's output constraints on logits: ``logit_bias``, then the grammar token bitmask.

Called by the sampler on the rows it samples from, after penalties and the min_tokens mask
(``Sampler.processed``), so plain decoding and speculative verification see the same masked
distribution. Constrained and unconstrained rows share the batch: only constrained rows are
filled and masked, the others pass through bit for bit.

A row is a ``Sequence`` or a view of one a few tokens ahead: an object with ``.seq`` and
``.extra`` (tokens assumed appended, e.g. speculative drafts[:j] for verification row j, see
backend/spec/verify.py). For such rows the choice's matcher accepts ``extra`` before filling and
rolls back afterwards, so the matcher's state is unchanged on return::

    rows of one choice with drafts d0 d1:  (seq, [])  (seq, [d0])  (seq, [d0, d1])
    matcher:                   fill row 0 | accept d0, fill row 1 | accept d1, fill row 2 | rollback 2

If a draft is refused by the grammar, the rows after it keep the mask of the last valid state:
the refused draft has probability 0 at its own row, so verification never reaches them.

    xgrammar bitmask: int32 [rows, ceil(V / 32)], bit t of a row set = token t allowed
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def _base(row):
    return getattr(row, "seq", row), getattr(row, "extra", ())


def needs_constraints(rows: list) -> bool:
    for r in rows:
        seq, _ = _base(r)
        if getattr(seq, "grammar", None) is not None or getattr(seq.params, "logit_bias", None):
            return True
    return False


def apply_constraints(logits: torch.Tensor, rows: Sequence[object]) -> torch.Tensor:
    """logits [R, V] for ``rows``, biased and masked **in place** (the sampler's own step tensor:
    a copy of a [16, 49152] batch cost more than filling its masks) and returned."""
    biased = [i for i, r in enumerate(rows) if getattr(_base(r)[0].params, "logit_bias", None)]
    constrained = [i for i, r in enumerate(rows) if getattr(_base(r)[0], "grammar", None) is not None]
    if not biased and not constrained:
        return logits
    if biased:
        _apply_bias(logits, [rows[i] for i in biased], biased)
    if constrained:
        _apply_masks(logits, rows, constrained)
    return logits


def _apply_bias(logits: torch.Tensor, rows: list, idx: list[int]) -> None:
    V = logits.shape[1]
    r_idx, t_idx, vals = [], [], []
    for i, r in zip(idx, rows):
        for t, b in _base(r)[0].params.logit_bias.items():
            if t < V:
                r_idx.append(i)
                t_idx.append(t)
                vals.append(b)
    dev = logits.device
    logits.index_put_((torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)),
                      torch.tensor(vals, device=dev, dtype=logits.dtype), accumulate=True)


def fill_bitmask(rows: list, constrained: list[int], vocab_size: int, *, full: bool = False) -> torch.Tensor:
    """The int32 bitmask of the constrained rows (module doc): [len(constrained), words], or with
    ``full`` [len(rows), words] with every other row all-allowed."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows) if full else len(constrained), vocab_size)
    advanced: dict[int, tuple[object, list[int], bool]] = {}   # id(state) -> (state, accepted, refused)
    for k, i in enumerate(constrained):
        k = i if full else k
        seq, extra = _base(rows[i])
        state = seq.grammar
        st, accepted, refused = advanced.get(id(state), (state, [], False))
        extra = list(extra)
        if accepted != extra[:len(accepted)] or len(extra) < len(accepted):
            state.rollback(len(accepted))              # a different run: start from the choice's state
            accepted, refused = [], False
        for t in extra[len(accepted):]:
            if refused or state.terminated or not state.accept(t):
                refused = True
                break
            accepted.append(t)
        advanced[id(state)] = (state, accepted, refused)
        if state.terminated:          # a draft ended the grammar: nothing after it is sampled
            bitmask[k].fill_(-1)
        else:
            state.fill(bitmask, k)
    for state, accepted, _ in advanced.values():
        state.rollback(len(accepted))
    return bitmask


def _apply_masks(logits: torch.Tensor, rows: list, constrained: list[int]) -> None:
    import xgrammar as xgr

    bitmask = fill_bitmask(rows, constrained, logits.shape[1], full=True).to(logits.device)
    xgr.apply_token_bitmask_inplace(logits, bitmask,
                                    indices=None if len(constrained) == len(rows) else constrained)
