"""The scheduler's step contract: what runs (``SchedulerOutput``), which rows sample
(``plan_sampling``), and what ``Scheduler.update_from_output`` changed (``StepOutcome``)."""
from __future__ import annotations

from collections import abc
from dataclasses import dataclass, field

from backend.engine.sequence import Request, Sequence
from backend.outputs import TokenLogprob

# What a step sampled for ``SchedulerOutput.sampling[i]``: one token id, or for a sequence that
# verified drafts the list of its accepted drafts plus one sampled token; its logprob(s) alike.
SampledTokens = abc.Sequence[int | list[int]]
SampledLogprobs = abc.Sequence[TokenLogprob | None | list[TokenLogprob | None]]


@dataclass
class SchedulerOutput:
    """What runs this step: each sequence with its chunk [num_computed_tokens, + num_new)."""
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    new_requests: list[Request] = field(default_factory=list)   # scheduled for the first time
    num_batched_tokens: int = 0
    # The sequences that sample this step (new forked choices right after their choice 0) and
    # the logits row each samples from; None = row i for sequence i (no fork this step).
    sampling: list[Sequence] = field(default_factory=list)
    logit_rows: list[int] | None = None
    forks: list[Sequence] = field(default_factory=list)         # new choices, registered in update
    num_drafts: int = 0        # draft tokens to verify this step (their sequences' spec_token_ids)


@dataclass
class StepOutcome:
    """What ``update_from_output`` changed (for deltas and stats)."""
    sampled: list[Sequence] = field(default_factory=list)      # got a token, in row order
    finished: list[Sequence] = field(default_factory=list)
    computed_tokens: int = 0
    recomputed_tokens: int = 0          # computed again after a preemption
    generated_tokens: int = 0           # tokens appended (accepted drafts included)
    drafted_tokens: int = 0             # draft tokens verified
    accepted_tokens: int = 0            # of those, accepted


def plan_sampling(out: SchedulerOutput) -> None:
    """A chunk that reaches its sequence's last token yields one logits row (batch.py), or
    k + 1 rows when it carries k draft tokens (``logit_rows`` then names each sequence's
    first row). An unforked n > 1 request samples all its choices from its one row: the
    prompt is shared."""
    rows: list[int] = []
    next_row = 0
    for seq, num_new in out.scheduled:
        if seq.request.pooling is not None:     # an embedding request pools instead (embedding.py)
            continue
        if seq.num_computed_tokens + num_new < seq.num_tokens + len(seq.spec_token_ids):
            continue
        row = next_row
        next_row += 1 + len(seq.spec_token_ids)
        out.num_drafts += len(seq.spec_token_ids)
        out.sampling.append(seq)
        rows.append(row)
        req = seq.request
        if not req.forked:
            for index in range(1, req.params.n):
                child = seq.fork(index)
                out.forks.append(child)
                out.sampling.append(child)
                rows.append(row)
    out.logit_rows = rows if out.forks or out.num_drafts else None
