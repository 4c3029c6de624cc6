"""Request and sequence state, and a step's plan over sequences.

A :class:`Request` is what a client submitted; it owns one :class:`Sequence` per choice. Until its
prompt is computed a request has a single sequence (choice 0); with ``n > 1`` the engine forks the
other choices from it once the prompt's KV exists, so they share the prompt's blocks.

Token bookkeeping of one sequence::

    token_ids:  [ prompt ........................ | output ............... ]
                 ^0                               ^num_prompt_tokens       ^num_tokens
    KV exists for token_ids[:num_computed_tokens]; the scheduler catches it up to num_tokens,
    and the step whose chunk reaches num_tokens samples the next token.

    output:     [ sent ........ | ready ..... | held ....... ]
                  ^0            ^num_sent     ^num_ready      ^num_output_tokens
    sent = streamed in a delta; ready = known not to begin a stop string; held = could still
    turn out to be (part of) a stop string, so not streamed yet.

With speculative decoding a decoding sequence (num_computed_tokens == num_tokens - 1) may carry
k draft tokens for one step; the step computes  token_ids[-1] + drafts  (k + 1 query rows) and
appends the accepted drafts plus one sampled token, so num_computed_tokens == num_tokens - 1 again.

A step's plan over them
-----------------------
The scheduler's step contract: what runs (``SchedulerOutput``), which rows sample
(``plan_sampling``), the flattened batch built from it (``build_batch``), and what
``Scheduler.update_from_output`` changed (``StepOutcome``).

The step's flattened, unpadded :class:`BatchInput`: sequences go back to back; each contributes
its chunk of new tokens::

    input_ids     [ s0 chunk ....... | s1 | s2 chunk .... | s3 ]
    cu_seqlens_q  0                  5    6               10   11
    logits rows   only for sequences whose chunk reaches their last known token (they sample):
                  cu_seqlens_q[i + 1] - 1   (the scheduler's SchedulerOutput.sampling, in order)

A decoding sequence with k draft tokens (speculative decoding) contributes its last token plus
the drafts, and every one of those k + 1 rows gets logits (the target's distribution after each
prefix of the drafts, which verification compares against)::

    input_ids     [ t_last d0 d1 d2 ]    logits rows  4 (all of them)

An embedding request's chunk has no logits row; its rows go in ``hidden_indices`` instead.
The index arithmetic (positions, slots, padded block tables) is backend/model/runner.py's ``build_batch``.
"""
from __future__ import annotations

import enum
import itertools
from collections import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from backend.engine.admission import SamplingParams
from backend.engine.embedding import hidden_rows
from backend.errors import EngineError
from backend.lora.batch import LoRABatch
from backend.model.runner import BatchInput, SeqChunk
from backend.model.runner import build_batch as build_chunks
from backend.outputs import TokenLogprob

if TYPE_CHECKING:
    from backend.kv_cache.manager import KVCacheManager
    from backend.engine.embedding import ResolvedPooling
    from backend.lora.adapter import LoRAAdapter
    from backend.structured.compiler import Grammar

_request_counter = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """One client request: prompt, settings, admission metadata, timing, its choices."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 max_tokens: int, stream: bool, salt: str | None, priority: int,
                 deadline: float | None, arrival_time: float, grammar: Grammar | None = None,
                 pooling: ResolvedPooling | None = None, lora: LoRAAdapter | None = None):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.max_tokens = max_tokens              # resolved: never None
        self.stream = stream
        self.salt = salt
        self.priority = priority                  # lower = sooner
        self.deadline = deadline                  # time.monotonic() seconds, or None
        self.arrival_time = arrival_time
        self.order = next(_request_counter)       # tie-break for equal arrival times
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.num_cached_tokens = 0                # prefix-cache hit at the first schedule
        self.forked = params.n == 1
        self.grammar = grammar                    # backend/structured Grammar, or None
        self.pooling = pooling                    # an embedding request (engine/embedding.py), or None
        self.lora = lora                          # its backend/lora LoRAAdapter (weights held), or None
        self.seqs: list[Sequence] = [Sequence(self, 0)]

    @property
    def finished(self) -> bool:
        return all(s.status is SeqStatus.FINISHED for s in self.seqs)

    @property
    def queue_time(self) -> float:
        if self.first_scheduled_time is None:
            return 0.0
        return self.first_scheduled_time - self.arrival_time


class Sequence:
    """One choice of a request: its tokens, KV progress, sampling and streaming state."""

    def __init__(self, request: Request, index: int, token_ids: list[int] | None = None):
        self.request = request
        self.index = index
        self.seq_id = f"{request.request_id}#{index}"       # key in the KV manager
        self.params = request.params
        self.token_ids = list(request.prompt_token_ids if token_ids is None else token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.high_water = 0        # most tokens ever computed (recomputation after preemption)
        self.status = SeqStatus.WAITING
        self.sort_key = (request.priority, request.arrival_time, request.order, index)
        self.num_preemptions = 0
        seed = request.params.seed
        self.generator: torch.Generator | None = None
        if seed is not None:
            # Choices get seed, seed + 1, ...: reproducible and distinct from each other.
            self.generator = torch.Generator().manual_seed((seed + index) % (1 << 63))
        # Structured output: this choice's own grammar matcher, advanced with its tokens.
        self.grammar = request.grammar.matcher() if request.grammar is not None else None
        self.logprobs: list[TokenLogprob] = []
        self.num_sent = 0
        self.num_ready = 0
        self.finish_reason: str | None = None
        self.error: EngineError | None = None    # why the engine ended it (abort / error only)
        self.stop_at = -1          # char offset of a matched stop string in the ready..end text
        self.cut_last_token = False  # finished on a stop token whose text must not be shown
        # Speculative decoding (backend/spec): this step's draft tokens, appended after token_ids
        # as extra query tokens, and the distribution each was drawn from ([k, V]; None = a
        # deterministic proposal). Set before schedule(), cleared once verified.
        self.spec_token_ids: list[int] = []
        self.spec_probs = None
        self.num_drafted = 0       # draft tokens verified for this choice (all steps)
        self.num_accepted = 0      # of those, accepted
        self.num_spec_steps = 0    # steps that verified drafts for this choice
        self.spec_policy = None    # the speculator's per-choice back-off state (backend/spec)
        # Embedding requests (backend/engine/embedding.py): the mean pooling's running sum over the
        # chunks computed so far, and the finished vector.
        self.pool_sum: torch.Tensor | None = None
        self.embedding: list[float] | None = None

    def __lt__(self, other: "Sequence") -> bool:     # heap order: priority, then arrival
        return self.sort_key < other.sort_key

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def waiting(self) -> bool:
        return self.status is SeqStatus.WAITING

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def output_slice(self, start: int, end: int | None = None) -> list[int]:
        """Output tokens [start, end) without copying the whole output."""
        p = self.num_prompt_tokens
        return self.token_ids[p + start:] if end is None else self.token_ids[p + start:p + end]

    def fork(self, index: int) -> "Sequence":
        """A sibling choice with the same prompt and no output yet (sampled in the same step)."""
        return Sequence(self.request, index)


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
    """A chunk that reaches its sequence's last token yields one logits row (build_batch), or
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


def build_batch(scheduled: list[tuple[Sequence, int]], kv: KVCacheManager, device: str | torch.device = "cpu",
                lora_info: dict[str, int] | None = None) -> BatchInput:
    """``lora_info``: the model's q_size / kv_size / intermediate when LoRA is on (else None)."""
    chunks: list[SeqChunk] = []
    pooled = False                          # an embedding request's chunk in the step
    for seq, num_new in scheduled:
        start = seq.num_computed_tokens
        end = start + num_new
        if seq.spec_token_ids:
            assert start == seq.num_tokens - 1 and num_new == 1 + len(seq.spec_token_ids), "drafts only on a decode"
            chunks.append(SeqChunk(seq.token_ids[start:] + seq.spec_token_ids, start,
                                   kv.block_table(seq.seq_id), all_logits=True))
            continue
        embed = seq.request.pooling is not None
        pooled |= embed
        chunks.append(SeqChunk(seq.token_ids[start:end], start, kv.block_table(seq.seq_id),
                               logits=end == seq.num_tokens and not embed))
    batch = build_chunks(chunks, kv.block_size, device)
    if lora_info is not None and any(seq.request.lora is not None for seq, _ in scheduled):
        batch.lora = LoRABatch.build([(seq.request.lora, len(c.token_ids)) for (seq, _), c in zip(scheduled, chunks)],
                                     q_size=lora_info["q_size"], kv_size=lora_info["kv_size"],
                                     intermediate=lora_info["intermediate"], device=device)
    rows = hidden_rows(scheduled) if pooled else None    # backend/engine/embedding.py
    if rows:                # (a last-token request's earlier chunks need none: any step path)
        batch.hidden_indices = torch.tensor(rows, dtype=torch.int64, device=device)
    return batch
