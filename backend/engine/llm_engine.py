"""LLMEngine: the step API. One step = schedule -> run the model -> sample -> stop checks -> deltas.

Single-threaded by design: EngineLoop (engine_loop.py) owns it on one thread; the offline LLM
drives it directly.
"""
from __future__ import annotations

import math
import time
from typing import Any

import torch

from backend.config import EngineArgs
from backend.context import context_window
from backend.detokenizer import window_start
from backend.engine.batch import build_batch
from backend.engine.errors import QueueFullError
from backend.engine.sampler import Sampler
from backend.engine.scheduler import Scheduler
from backend.engine.sequence import Request, SeqStatus, Sequence
from backend.engine.stats import EngineStats
from backend.engine.stop_checker import StopChecker
from backend.outputs import StepDelta
from backend.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, model_dir: Any, args: EngineArgs | None = None, *, runner: Any = None,
                 tokenizer: Any = None, kv_cache: Any = None):
        """``runner`` / ``tokenizer`` / ``kv_cache`` replace the real ones (tests)."""
        self.args = args = args or EngineArgs()
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        if runner is None:
            from backend.model.runner import ModelRunner
            runner = ModelRunner(str(model_dir), args)
        self.runner = runner
        if tokenizer is None and model_dir is not None:
            from transformers import PreTrainedTokenizerFast
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
        self.tokenizer = tokenizer
        if kv_cache is None:
            from backend.kv_cache.manager import KVCacheManager
            kv_cache = KVCacheManager(
                storage=runner.storage, num_blocks=runner.num_blocks, block_size=args.block_size,
                enable_prefix_caching=args.enable_prefix_caching, host_tier_blocks=args.host_tier_blocks,
                disk_tier_path=args.disk_tier_path, disk_tier_blocks=args.disk_tier_blocks)
        self.kv = kv_cache
        info = runner.info
        self.vocab_size = info.vocab_size
        self.eos_token_ids = list(info.eos_token_ids)
        # One sequence must always fit the pool alone, so the pool also bounds the context.
        self.max_model_len = context_window(info.max_model_len, runner.num_blocks, args.block_size)
        self.scheduler = Scheduler(self.kv, max_num_seqs=args.max_num_seqs,
                                   max_num_batched_tokens=args.max_num_batched_tokens)
        self.sampler = Sampler(self.vocab_size, self.eos_token_ids, seed=args.seed)
        self.stop_checker = StopChecker(tokenizer, self.eos_token_ids, self.max_model_len)
        self.device = args.device
        self._requests: dict[str, Request] = {}
        self._deadlines: dict[str, Request] = {}
        self._pending: list[StepDelta] = []      # finals of aborts/expiries, returned by step()
        self._stats = EngineStats()

    # -- admission -------------------------------------------------------------------------
    def validate_request(self, request_id: str, prompt_token_ids: list[int],
                         params: SamplingParams | None) -> int:
        """Raise ValueError for a request that can never run; return its resolved max_tokens."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params is not None and not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params = params or SamplingParams()
        params.validate()
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty: at least one token is needed")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size
               for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        limit = self.max_model_len
        if n >= limit:
            raise ValueError(f"prompt has {n} tokens, which leaves no room to generate: "
                             f"max_model_len is {limit} tokens")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
        if n + max_tokens > limit:
            raise ValueError(f"prompt has {n} tokens and max_tokens is {max_tokens}: {n + max_tokens} "
                             f"tokens exceed max_model_len of {limit} tokens")
        if params.min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({max_tokens})")
        if params.n > self.args.max_num_seqs:
            raise ValueError(f"n ({params.n}) exceeds max_num_seqs ({self.args.max_num_seqs})")
        return max_tokens

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    *, stream: bool = True, salt: str | None = None, priority: int = 0,
                    deadline: float | None = None, arrival_time: float | None = None) -> None:
        """Queue a request. ``deadline`` is a time.monotonic() instant. Raises ValueError for an
        invalid request and QueueFullError when ``max_waiting`` sequences are already waiting."""
        prompt_token_ids = list(prompt_token_ids)
        max_tokens = self.validate_request(request_id, prompt_token_ids, params)
        if self.scheduler.num_waiting >= self.args.max_waiting:
            self._stats.num_rejected += 1
            raise QueueFullError(f"{self.scheduler.num_waiting} requests are waiting "
                                 f"(max_waiting={self.args.max_waiting})", retry_after=self.retry_after())
        req = Request(request_id, prompt_token_ids, params or SamplingParams(), max_tokens=max_tokens,
                      stream=stream, salt=salt, priority=int(priority), deadline=deadline,
                      arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        self._requests[request_id] = req
        if deadline is not None:
            self._deadlines[request_id] = req
        self.scheduler.add(req.seqs[0])

    def retry_after(self) -> float:
        """Seconds a rejected client should wait: about one running batch's worth of work."""
        return float(max(1, math.ceil(self.scheduler.num_waiting / max(1, self.args.max_num_seqs))))

    def abort_request(self, request_id: str) -> bool:
        """Finish a request now (blocks freed on return); its final deltas come from step()."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._stats.num_aborted += 1
        self._finish_request(req, "abort", None)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pending)

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[StepDelta]:
        deltas, self._pending = self._pending, []
        if self._deadlines:
            self._expire(deltas)
        sched = self.scheduler.schedule()
        self._stats.num_steps += 1
        if not sched.scheduled:
            return deltas
        batch, samplers = build_batch(sched.scheduled, self.kv, self.device)
        logits = self.runner.execute(batch)      # also writes KV for chunks that do not sample
        stats = self._stats
        for req in sched.new_requests:
            stats.prompt_tokens += len(req.prompt_token_ids)
            stats.cached_prompt_tokens += req.num_cached_tokens
        for seq, num_new in sched.scheduled:
            start = seq.num_computed_tokens
            seq.num_computed_tokens = start + num_new
            stats.computed_tokens += num_new
            stats.recomputed_tokens += max(0, min(seq.high_water, start + num_new) - start)
            seq.high_water = max(seq.high_water, seq.num_computed_tokens)
            self.kv.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        if not samplers:
            return deltas
        rows, row_seqs = self._fork_choices(samplers)
        if rows is not None:
            logits = logits[torch.tensor(rows, device=logits.device)]
        tokens, logprobs = self.sampler(logits, row_seqs)
        now = time.monotonic()
        for seq, token, lp in zip(row_seqs, tokens, logprobs):
            req = seq.request
            if req.first_token_time is None:
                req.first_token_time = now
            seq.token_ids.append(token)
            if lp is not None:
                seq.logprobs.append(lp)
            stats.generation_tokens += 1
            self.stop_checker.check(seq, token)
            if seq.finish_reason is not None:
                self._finish_seq(seq)
            delta = self._delta(seq)
            if delta is not None:
                deltas.append(delta)
            if seq.finished and req.finished:
                self._close(req)
        return deltas

    def _fork_choices(self, samplers: list[Sequence]) -> tuple[list[int] | None, list[Sequence]]:
        """n > 1: a request whose prompt just finished gets n rows from its one logits row, and
        its other choices share the prompt's KV blocks (copy-on-write later)."""
        if all(s.request.forked for s in samplers):
            return None, samplers
        rows: list[int] = []
        row_seqs: list[Sequence] = []
        for i, seq in enumerate(samplers):
            rows.append(i)
            row_seqs.append(seq)
            req = seq.request
            if req.forked:
                continue
            req.forked = True
            for index in range(1, req.params.n):
                child = seq.fork(index)
                self.kv.fork(seq.seq_id, child.seq_id)
                child.num_computed_tokens = child.high_water = seq.num_computed_tokens
                self.scheduler.add_running(child)
                req.seqs.append(child)
                rows.append(i)
                row_seqs.append(child)
        return rows, row_seqs

    # -- finishing -------------------------------------------------------------------------
    def _finish_seq(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        reason = seq.finish_reason or "abort"
        self._stats.finished[reason] = self._stats.finished.get(reason, 0) + 1

    def _finish_request(self, req: Request, reason: str, error: str | None) -> None:
        """Abort / expire / fail every open choice of a request; finals go to the next step()."""
        for seq in req.seqs:
            if not seq.finished:
                seq.finish_reason, seq.error = reason, error
                self._finish_seq(seq)
                self._emit_pending(seq)
        if not req.forked:          # the client still expects one final per choice
            req.forked = True
            for index in range(1, req.params.n):
                child = req.seqs[0].fork(index)
                child.status, child.finish_reason, child.error = SeqStatus.FINISHED, reason, error
                self._stats.finished[reason] = self._stats.finished.get(reason, 0) + 1
                req.seqs.append(child)
                self._emit_pending(child)
        self._close(req)

    def _emit_pending(self, seq: Sequence) -> None:
        delta = self._delta(seq)
        if delta is not None:
            self._pending.append(delta)

    def _close(self, req: Request) -> None:
        self._requests.pop(req.request_id, None)
        self._deadlines.pop(req.request_id, None)

    def _expire(self, deltas: list[StepDelta]) -> None:
        now = time.monotonic()
        for req in [r for r in self._deadlines.values() if r.deadline <= now]:
            self._stats.num_deadline_exceeded += 1
            self._finish_request(req, "abort", "deadline exceeded")
        deltas.extend(self._pending)
        self._pending = []

    def fail_all(self, error: str) -> list[StepDelta]:
        """Finish every open request with finish_reason "error" (the engine loop crashed)."""
        for req in list(self._requests.values()):
            try:
                self._finish_request(req, "error", error)
            except Exception:          # the KV state may be what broke; still tell the client
                self._close(req)
        deltas, self._pending = self._pending, []
        return deltas

    # -- deltas ----------------------------------------------------------------------------
    def _delta(self, seq: Sequence) -> StepDelta | None:
        req = seq.request
        finished = seq.finish_reason is not None
        if not finished and (not req.stream or seq.num_ready == seq.num_sent):
            return None
        end = seq.num_output_tokens if finished else seq.num_ready
        ws = window_start(seq.num_sent)
        max_chars = self.stop_checker.chars_before_cut(seq) if finished else -1
        delta = StepDelta(
            request_id=req.request_id, index=seq.index,
            new_token_ids=seq.output_slice(seq.num_sent, end), window_ids=seq.output_slice(ws, end),
            num_sent=seq.num_sent - ws, max_chars=max_chars, finished=finished,
            finish_reason=seq.finish_reason, error=seq.error,
            logprobs=seq.logprobs[seq.num_sent:end] if seq.logprobs else [],
            prompt_tokens=seq.num_prompt_tokens, completion_tokens=seq.num_output_tokens,
            cached_tokens=req.num_cached_tokens, queue_time=req.queue_time,
            num_preemptions=seq.num_preemptions)
        seq.num_sent = end
        return delta

    # -- stats -----------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        s = self._stats
        kv = self.kv.stats()
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=self.scheduler.num_waiting,
            num_requests=len(self._requests), kv_usage=kv.usage, kv=kv, num_steps=s.num_steps,
            prompt_tokens=s.prompt_tokens, cached_prompt_tokens=s.cached_prompt_tokens,
            generation_tokens=s.generation_tokens, computed_tokens=s.computed_tokens,
            recomputed_tokens=s.recomputed_tokens, num_preemptions=self.scheduler.num_preemptions,
            num_aborted=s.num_aborted, num_deadline_exceeded=s.num_deadline_exceeded,
            num_rejected=s.num_rejected, finished=dict(s.finished))
