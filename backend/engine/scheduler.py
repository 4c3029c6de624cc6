"""Iteration-level scheduler: one token budget per step, chunked prefill, preemption, and what
happens after the model ran (``update_from_output``).

The one rule (as in vLLM v1): every scheduled sequence's ``num_computed_tokens`` catches up with
its ``num_tokens`` under a shared per-step budget of ``max_num_batched_tokens``. A decode costs one
token; a prompt costs as many tokens as the budget has left, so a long prompt is split across
steps (chunked prefill) while running streams keep decoding. There are no prefill/decode phases.

Order of a step:
  1. running sequences, highest priority first (priority, then arrival). When the KV pool is
     full, the lowest-priority, latest-arrived running sequence is preempted (blocks freed,
     recomputed later from its tokens, so its output does not change) until the allocation fits.
  2. waiting sequences by (priority, arrival), only if nothing was preempted: first time, attach
     cached prefix blocks; stop at the first one that does not fit (no overtaking). A waiting
     sequence may preempt a running one of strictly lower priority.
  3. the sequences whose chunk reaches their last token sample; with ``n > 1`` a request whose
     prompt completes lists its other choices too (new Sequences sharing choice 0's logits row).
After the model ran, ``update_from_output`` advances computed counts, commits KV blocks, gives
the new choices the prompt's blocks, appends the sampled tokens, checks stops and finishes.

The scheduler never touches the block pool: it asks the KV manager for room and gets yes/no.
It owns the open requests (``requests``), so finishing and closing happen in one place.
"""
from __future__ import annotations

import heapq
import time
from typing import TYPE_CHECKING, cast

from backend.engine.embedding import prefix_tokens
from backend.engine.sequence import (Request, SampledLogprobs, SampledTokens, SchedulerOutput, SeqStatus, Sequence,
                                     StepOutcome, plan_sampling)
from backend.errors import EngineError
from backend.outputs import TokenLogprob

if TYPE_CHECKING:
    from backend.engine.admission import TenantFairness
    from backend.outputs import StopChecker
    from backend.kv_cache.manager import KVCacheManager


class Scheduler:
    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 stop_checker: StopChecker | None = None):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.stop_checker = stop_checker           # needed by update_from_output only
        self.requests: dict[str, Request] = {}     # open requests
        self._deadlines: dict[str, Request] = {}
        self.running: dict[Sequence, None] = {}    # insertion-ordered set, O(1) removal
        self._waiting: list[Sequence] = []          # heap; finished entries are dropped lazily
        self.num_waiting = 0
        self.num_preemptions = 0
        self.fairness: TenantFairness | None = None  # tenant caps + aging (engine/admission.py)

    # -- requests --------------------------------------------------------------------------
    def add_request(self, req: Request, *, computed: bool = False) -> None:
        """``computed``: choice 0's KV is already written up to its num_computed_tokens (a
        prefill engine's hand-over, backend/disagg/decode.py), so it runs without waiting."""
        self.requests[req.request_id] = req
        if req.deadline is not None:
            self._deadlines[req.request_id] = req
        if computed:
            self.add_running(req.seqs[0])
        else:
            self.add(req.seqs[0])

    def expired(self, now: float) -> list[Request]:
        return [r for r in self._deadlines.values() if r.deadline is not None and r.deadline <= now]

    def finish_request(self, req: Request, reason: str, error: EngineError | None) -> list[Sequence]:
        """Abort / expire / fail every open choice (blocks free on return); returns the choices
        finished now, one per choice the client still expects a final for."""
        done = []
        for seq in req.seqs:
            if not seq.finished:
                seq.finish_reason, seq.error = reason, error
                self.finish(seq)
                done.append(seq)
        if not req.forked:          # the client still expects one final per choice
            req.forked = True
            for index in range(1, req.params.n):
                child = req.seqs[0].fork(index)
                child.status, child.finish_reason, child.error = SeqStatus.FINISHED, reason, error
                req.seqs.append(child)
                done.append(child)
        self._close(req)
        return done

    def _close(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        self._deadlines.pop(req.request_id, None)

    # -- queue operations ------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        heapq.heappush(self._waiting, seq)
        self.num_waiting += 1

    def add_running(self, seq: Sequence) -> None:
        """A forked choice whose KV already exists (shared with its parent)."""
        seq.status = SeqStatus.RUNNING
        self.running[seq] = None

    def finish(self, seq: Sequence) -> None:
        """Finish, abort or expire a sequence in any state; its blocks are free on return."""
        if seq.status is SeqStatus.RUNNING:
            del self.running[seq]
            self.kv.free(seq.seq_id)
        elif seq.status is SeqStatus.WAITING:
            self.num_waiting -= 1               # its heap entry is skipped when it surfaces
        seq.status = SeqStatus.FINISHED

    def _peek_waiting(self) -> Sequence | None:
        while self._waiting and self._waiting[0].status is not SeqStatus.WAITING:
            heapq.heappop(self._waiting)
        return self._waiting[0] if self._waiting else None

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        del self.running[seq]
        seq.spec_token_ids, seq.spec_probs = [], None
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        self.add(seq)          # keeps its arrival time, so it comes back before later arrivals

    # -- before the step -------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        order = sorted(self.running, key=lambda s: s.sort_key)
        self.running = dict.fromkeys(order)
        lo = 0                                 # order[lo:hi] still to visit; victims from hi-1
        hi = len(order)
        while lo < hi and budget > 0:
            seq = order[lo]
            lo += 1
            num_new = self._num_new_with_drafts(seq, budget)
            if seq.spec_token_ids and not self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens + num_new):
                seq.spec_token_ids, seq.spec_probs = [], None     # drafts never cost a preemption
                num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            fits = True
            while not self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens + num_new):
                if lo < hi:
                    hi -= 1
                    self._preempt(order[hi], out)
                else:
                    self._preempt(seq, out)
                    fits = False
                    break
            if not fits:
                break
            out.scheduled.append((seq, num_new))
            budget -= num_new
        for seq in order[lo:hi]:            # not scheduled this step: their drafts are stale
            seq.spec_token_ids, seq.spec_probs = [], None
        if not out.preempted:
            budget = self._admit_waiting(out, budget)
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        plan_sampling(out)
        return out

    @staticmethod
    def _num_new_with_drafts(seq: Sequence, budget: int) -> int:
        """Tokens to compute for a running sequence, its draft tokens included; drafts that do
        not fit the budget are dropped (a draft run is only useful as a prefix)."""
        missing = seq.num_tokens - seq.num_computed_tokens
        num_new = min(missing + len(seq.spec_token_ids), budget)
        keep = max(0, num_new - missing)
        if keep < len(seq.spec_token_ids):
            seq.spec_token_ids = seq.spec_token_ids[:keep]
            if seq.spec_probs is not None:
                seq.spec_probs = seq.spec_probs[:keep] if keep else None
        return num_new

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        if self.fairness is not None:
            self.fairness.before_admit(self)
        now = time.monotonic()
        seats_used = self._seats_in_use()
        while budget > 0:
            seq = self._peek_waiting()
            if seq is None:
                break
            req = seq.request
            seats = 1 if req.forked else req.params.n
            if seats_used + seats > self.max_num_seqs:
                break
            tokens = seq.token_ids if req.pooling is None else prefix_tokens(seq)    # embedding.py
            cached = self.kv.acquire_prefix(seq.seq_id, tokens, req.salt)
            if cached is None:
                break
            num_new = min(seq.num_tokens - cached, budget)
            while not self.kv.allocate_slots(seq.seq_id, cached + num_new):
                if not self._preempt_lower_priority(seq, out):
                    self.kv.free(seq.seq_id)        # undo the prefix attach
                    return budget
                budget = self.max_num_batched_tokens - sum(n for _, n in out.scheduled)
                seats_used = self._seats_in_use()
                num_new = min(seq.num_tokens - cached, budget)
                if num_new <= 0:
                    self.kv.free(seq.seq_id)
                    return budget
            heapq.heappop(self._waiting)
            self.num_waiting -= 1
            seq.status = SeqStatus.RUNNING
            seq.num_computed_tokens = cached
            self.running[seq] = None
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
                req.num_cached_tokens = cached
                out.new_requests.append(req)
            out.scheduled.append((seq, num_new))
            budget -= num_new
            seats_used += seats
        return budget

    def _seats_in_use(self) -> int:
        """Running sequences, counting an unforked request as the n it becomes after its prompt."""
        return sum(1 if s.request.forked else s.request.params.n for s in self.running)

    def _preempt_lower_priority(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Make room for a waiting sequence by preempting a running one of lower priority."""
        victims = [s for s in self.running if s.sort_key[0] > seq.sort_key[0]]
        if not victims:
            return False
        victim = max(victims, key=lambda s: s.sort_key)
        out.scheduled = [(s, n) for s, n in out.scheduled if s is not victim]
        self._preempt(victim, out)
        return True

    # -- after the step --------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, tokens: SampledTokens, logprobs: SampledLogprobs
                           ) -> StepOutcome:
        """The model ran ``out`` and the sampler drew ``tokens`` for ``out.sampling``: advance
        KV progress, register new choices, append tokens, stop and finish.

        ``tokens[i]`` is one token id, or for a sequence that verified drafts the list of its
        accepted drafts plus one sampled token (``logprobs[i]`` then a list as long)."""
        outcome = StepOutcome(sampled=out.sampling)
        for seq, num_new in out.scheduled:
            outcome.computed_tokens += num_new
            if seq.spec_token_ids:
                continue                   # KV progress known once verified (_append_run)
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            seq.num_computed_tokens = end
            outcome.recomputed_tokens += max(0, min(seq.high_water, end) - start)
            seq.high_water = max(seq.high_water, end)
            if seq.request.pooling is None:       # embeddings commit nothing (embedding.py)
                self.kv.commit(seq.seq_id, seq.token_ids, end)
        for child in out.forks:            # after the commit: the fork copies the chain state
            req = child.request
            parent = req.seqs[0]
            self.kv.fork(parent.seq_id, child.seq_id)
            child.num_computed_tokens = child.high_water = parent.num_computed_tokens
            self.add_running(child)
            req.seqs.append(child)
            req.forked = True
        now = time.monotonic()
        for seq, token, lp in zip(out.sampling, tokens, logprobs):
            req = seq.request
            if req.first_token_time is None:
                req.first_token_time = now
            # A run's logprobs are a list as long as the run (the pairing mypy cannot follow).
            if isinstance(token, list):
                self._append_run(seq, token, cast("list[TokenLogprob | None]", lp), outcome)
            else:
                self._append(seq, token, cast("TokenLogprob | None", lp))
                outcome.generated_tokens += 1
            if seq.finish_reason is not None:
                self.finish(seq)
                outcome.finished.append(seq)
                if req.finished:
                    self._close(req)
        return outcome

    def _append(self, seq: Sequence, token: int, lp: TokenLogprob | None) -> None:
        seq.token_ids.append(token)
        if lp is not None:
            seq.logprobs.append(lp)
        assert self.stop_checker is not None, "update_from_output needs the stop checker"
        self.stop_checker.check(seq, token)
        if seq.grammar is not None:          # structured output: the matcher follows every token
            seq.grammar.advance(seq, token)

    def _append_run(self, seq: Sequence, run: list[int], lps: list[TokenLogprob | None],
                    outcome: StepOutcome) -> None:
        """Append a verified run token by token, stopping exactly where a stop condition hits
        (the rest of the run is dropped). KV of the rejected drafts is rolled back: the computed
        count covers the old tokens plus the accepted drafts, blocks past the new length are
        freed, and only full blocks of accepted tokens are committed to the prefix cache."""
        drafts = seq.spec_token_ids
        base = seq.num_tokens
        valid = base + len(run) - 1                    # KV written for old tokens + accepted drafts
        seq.num_spec_steps += 1
        seq.num_drafted += len(drafts)
        seq.num_accepted += len(run) - 1
        outcome.drafted_tokens += len(drafts)
        outcome.accepted_tokens += len(run) - 1
        seq.spec_token_ids, seq.spec_probs = [], None
        for token, lp in zip(run, lps):
            self._append(seq, token, lp)
            outcome.generated_tokens += 1
            if seq.finish_reason is not None:
                break
        seq.num_computed_tokens = min(valid, seq.num_tokens - 1)
        seq.high_water = max(seq.high_water, seq.num_computed_tokens)
        if seq.finish_reason is None:
            self.kv.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            self.kv.truncate(seq.seq_id, seq.num_tokens)
