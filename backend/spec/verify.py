"""Exact verification of draft tokens (speculative sampling, Leviathan et al. / Chen et al.).

A sequence with k drafts got k + 1 logits rows; row j is the target's distribution after the old
tokens plus drafts[:j]. Each row is processed exactly as plain decoding would process it at that
point (penalties over the output *including* the accepted drafts, the min_tokens mask by output
length, temperature, min-p, top-k, top-p), through the sampler's own code, so what is compared
against is the distribution plain decoding would sample from. Then, position by position:

- greedy: accept draft j while it equals the row's argmax; the first mismatch emits the argmax,
  and a fully accepted run emits the bonus argmax of row k. Output = plain greedy.
- sampled, deterministic draft (q = point mass at x: prompt lookup, greedy drafts): draw
  y ~ p_j with the sequence's own generator; y == x accepts, else y is emitted and the run ends.
  That *is* rejection sampling for a point mass (accept with p(x) = min(1, p(x)/q(x)); on
  rejection y ~ p restricted to y != x, the normalised residual (p - q)+), and it consumes one
  draw per emitted token, exactly as plain sampling does, so seeded runs repeat.
- sampled, drawn draft (q a distribution: a sampling draft model): accept x with probability
  min(1, p(x)/q(x)) (u ~ U[0, 1) from the sequence's generator); on rejection draw from the
  normalised (p - q)+; after k acceptances draw the bonus token from p_k.
Either way each emitted token is distributed exactly as under plain sampling.

Logprobs are the raw target logprobs of the emitted token at its own row, as in plain decoding.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from backend.engine.sampler import row_argmax

if TYPE_CHECKING:
    from backend.engine.sampler import Sampler


class _Ahead:
    """A sequence as it would be after ``extra`` accepted drafts (what its row j samples as)."""
    __slots__ = ("seq", "extra")

    def __init__(self, seq, extra: list[int]):
        self.seq, self.extra = seq, extra

    @property
    def params(self):
        return self.seq.params

    @property
    def generator(self):
        return self.seq.generator

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.extra

    @property
    def output_ids(self) -> list[int]:
        return self.seq.output_ids + self.extra

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.extra)


@torch.inference_mode()
def verify(sampler: Sampler, logits: torch.Tensor, seqs: list, first_rows: list[int]
           ) -> tuple[list, list]:
    """``seqs[i]`` has rows ``first_rows[i] .. + len(seqs[i].spec_token_ids)`` of ``logits``.
    Returns per sequence a token id (no drafts) or the list accepted drafts + one token, and its
    logprob(s) in the same shape (None when not requested)."""
    views, rows, spans = [], [], []
    for seq, r in zip(seqs, first_rows):
        drafts = seq.spec_token_ids
        spans.append(len(views))
        for j in range(len(drafts) + 1):
            views.append(_Ahead(seq, drafts[:j]))
            rows.append(r + j)
    x = logits[torch.tensor(rows, device=logits.device)]
    want_lp = any(v.params.logprobs is not None for v in views)
    raw = torch.log_softmax(x, dim=-1) if want_lp else None
    x = sampler.processed(x, views)
    argmax = row_argmax(x).tolist()
    sampled = [i for i, v in enumerate(views) if not v.params.greedy]
    probs = {}
    if sampled:
        p = sampler.probs(x[torch.tensor(sampled, device=x.device)], [views[i] for i in sampled])
        probs = {i: p[n] for n, i in enumerate(sampled)}

    tokens, logprobs = [], []
    for seq, v0 in zip(seqs, spans):
        drafts = seq.spec_token_ids
        if seq.params.greedy:
            run = _greedy_run(drafts, argmax[v0:v0 + len(drafts) + 1])
        else:
            run = _sampled_run(sampler, seq, drafts, [probs[v0 + j] for j in range(len(drafts) + 1)])
        lps = [None] * len(run)
        if seq.params.logprobs is not None:
            idx = torch.arange(v0, v0 + len(run), device=raw.device)
            lps = sampler.logprobs(raw[idx], torch.tensor(run, device=raw.device), [seq.params] * len(run))
        if drafts:
            tokens.append(run)
            logprobs.append(lps)
        else:
            tokens.append(run[0])
            logprobs.append(lps[0])
    return tokens, logprobs


def _greedy_run(drafts: list[int], targets: list[int]) -> list[int]:
    run = []
    for d, t in zip(drafts, targets):
        if d != t:
            break
        run.append(d)
    run.append(targets[len(run)])
    return run


def _sampled_run(sampler: Sampler, seq, drafts: list[int], probs: list[torch.Tensor]) -> list[int]:
    gen, q = seq.generator, seq.spec_probs
    run = []
    for j, x in enumerate(drafts):
        p = probs[j]
        if q is None:
            y = sampler.race(p, gen)
            run.append(y)
            if y != x:
                return run
            continue
        qx = float(q[j, x])
        if sampler.uniform(gen) * qx < float(p[x]):
            run.append(x)
            continue
        residual = (p - q[j].to(p.device)).clamp_min_(0)
        total = float(residual.sum())
        run.append(sampler.race(residual / total if total > 0 else p, gen))
        return run
    run.append(sampler.race(probs[len(drafts)], gen))
    return run
