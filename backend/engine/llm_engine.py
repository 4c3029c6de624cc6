"""LLMEngine: the step API. One step = (propose drafts) -> schedule -> run the model -> sample
(or verify drafts) -> update -> deltas. Embedding requests (``add_request(..., pooling=)``) ride the
same steps and finish at the end of their prompt with a pooled vector (embedding.py).

Single-threaded by design: EngineLoop (engine_loop.py) owns it on one thread; the offline LLM
drives it directly. Admission rules live in admission.py (pure, any thread), what happens after
the model ran in Scheduler.update_from_output, deltas in backend/outputs.py. The engine's counters
(:class:`StatsRecorder`, engine thread only) are published as :class:`EngineStats` snapshots, safe
to hand to other threads (EngineLoop publishes one after every step) for metrics and tests.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from backend.config import EngineConfig, LoRAConfig
from backend.context import context_window
from backend.engine.admission import EngineLimits, check_queue, duplicate_id, validate_request
from backend.engine.embedding import absorb, embedding_delta, validate_embed
from backend.engine.sampler import Sampler
from backend.engine.scheduler import Scheduler
from backend.engine.sequence import (Request, SampledLogprobs, SampledTokens, SchedulerOutput, Sequence, StepOutcome,
                                     build_batch)
from backend.outputs import StopChecker, make_deltas
from backend.errors import EngineError, ErrorKind, deadline_exceeded, invalid_request, unavailable
from backend.kv_cache.block_pool import extra_key
from backend.kv_cache.manager import KVCacheManager, KVCacheStats
from backend.lora.adapter import LoRAAdapter, LoRAError
from backend.lora.registry import UnknownAdapter
from backend.model.pooling import PoolingConfig
from backend.outputs import StepDelta
from backend.pooling_params import PoolingParams
from backend.engine.admission import SamplingParams
from backend.structured.compiler import Grammars
from backend.spec.config import SpeculativeConfig
from backend.spec.speculator import make_speculator
from backend.spec.verify import verify


@dataclass
class EngineStats:
    # gauges
    num_running: int = 0              # sequences holding KV blocks
    num_waiting: int = 0              # sequences queued (new or preempted)
    num_requests: int = 0             # open requests
    kv_usage: float = 0.0             # fraction of device KV blocks in use
    kv: KVCacheStats = field(default_factory=KVCacheStats)
    # counters (monotonic)
    num_steps: int = 0
    prompt_tokens: int = 0            # prompt tokens of admitted requests (cached ones included)
    cached_prompt_tokens: int = 0     # of those, served from the prefix cache at first schedule
    generation_tokens: int = 0        # sampled tokens
    computed_tokens: int = 0          # tokens run through the model, recomputation included
    recomputed_tokens: int = 0        # recomputed after a preemption (computed - useful)
    num_preemptions: int = 0
    num_aborted: int = 0              # abort_request calls that found an open request
    num_deadline_exceeded: int = 0
    num_rejected: int = 0             # queue_full at admission
    finished: dict[str, int] = field(default_factory=dict)   # choices by finish reason
    # speculative decoding (backend/spec); spec_method "" = off
    spec_method: str = ""
    spec_drafted_tokens: int = 0      # draft tokens verified
    spec_accepted_tokens: int = 0     # of those, accepted
    spec_num_drafts: int = 0          # (sequence, step) pairs that verified drafts

    @property
    def useful_tokens(self) -> int:
        return self.computed_tokens - self.recomputed_tokens

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_drafted_tokens if self.spec_drafted_tokens else 0.0


class StatsRecorder:
    """The engine's monotonic counters (engine thread only)."""

    def __init__(self) -> None:
        self.counters = EngineStats()

    def record_schedule(self, out: SchedulerOutput) -> None:
        c = self.counters
        c.num_steps += 1
        c.spec_num_drafts += sum(1 for s in out.sampling if s.spec_token_ids)
        for req in out.new_requests:
            c.prompt_tokens += len(req.prompt_token_ids)
            c.cached_prompt_tokens += req.num_cached_tokens

    def record_step(self, outcome: StepOutcome) -> None:
        c = self.counters
        c.computed_tokens += outcome.computed_tokens
        c.recomputed_tokens += outcome.recomputed_tokens
        c.generation_tokens += outcome.generated_tokens
        c.spec_drafted_tokens += outcome.drafted_tokens
        c.spec_accepted_tokens += outcome.accepted_tokens
        self.record_finished(outcome.finished)

    def record_rejected(self) -> None:
        self.counters.num_rejected += 1

    def record_aborted(self) -> None:
        self.counters.num_aborted += 1

    def record_deadline_exceeded(self) -> None:
        self.counters.num_deadline_exceeded += 1

    def record_finished(self, seqs: list[Sequence]) -> None:
        finished = self.counters.finished
        for seq in seqs:
            reason = seq.finish_reason or "abort"
            finished[reason] = finished.get(reason, 0) + 1

    def snapshot(self, scheduler: Scheduler, kv: KVCacheManager) -> EngineStats:
        kv_stats = kv.stats()
        return replace(self.counters, num_running=len(scheduler.running), num_waiting=scheduler.num_waiting,
                       num_requests=len(scheduler.requests), kv_usage=kv_stats.usage, kv=kv_stats,
                       num_preemptions=scheduler.num_preemptions, finished=dict(self.counters.finished))


class LLMEngine:
    def __init__(self, model_dir: Any, config: EngineConfig | None = None, *, lora: LoRAConfig | None = None,
                 runner: Any = None, tokenizer: Any = None, kv_cache: Any = None):
        """``config``: the engine part of the options (backend/config.py); ``lora``: adapter slots
        (None: LoRA off). ``runner`` / ``tokenizer`` / ``kv_cache`` replace the real ones (tests)."""
        self.config = args = config or EngineConfig()
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        if runner is None:
            from backend.model.runner import ModelRunner
            runner = ModelRunner(str(model_dir), args, lora)
        self.runner = runner
        if tokenizer is None and model_dir is not None:
            from transformers import PreTrainedTokenizerFast
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
        self.tokenizer = tokenizer
        if kv_cache is None:
            kv_cache = KVCacheManager(
                storage=runner.storage, num_blocks=runner.num_blocks, block_size=args.block_size,
                enable_prefix_caching=args.enable_prefix_caching, host_tier_blocks=args.host_tier_blocks,
                disk_tier_path=args.disk_tier_path, disk_tier_blocks=args.disk_tier_blocks)
        self.kv = kv_cache
        info = runner.info
        self.eos_token_ids = list(info.eos_token_ids)
        # One sequence must always fit the pool alone, so the pool also bounds the context.
        self.limits = EngineLimits(vocab_size=info.vocab_size,
                                   max_model_len=context_window(info.max_model_len, runner.num_blocks,
                                                                args.block_size),
                                   max_num_seqs=args.max_num_seqs, max_waiting=args.max_waiting)
        # How embedding requests pool (the checkpoint's; a test's fake runner may have none).
        self.pooling_config = getattr(runner, "pooling", None) or PoolingConfig()
        self.stop_checker = StopChecker(tokenizer, self.eos_token_ids, self.max_model_len)
        self.scheduler = Scheduler(self.kv, max_num_seqs=args.max_num_seqs, stop_checker=self.stop_checker,
                                   max_num_batched_tokens=args.max_num_batched_tokens)
        self.sampler = Sampler(info.vocab_size, self.eos_token_ids, seed=args.seed)
        # Structured outputs: grammars compiled once per (schema, this tokenizer), thread-safe.
        self.grammars = Grammars(tokenizer, info.vocab_size, self.eos_token_ids)
        self.speculator = make_speculator(SpeculativeConfig.parse(args.speculative_config), args=args,
                                          runner=runner, max_model_len=self.max_model_len)
        self.device = args.device
        self.stats_recorder = StatsRecorder()
        self._finals: list[StepDelta] = []      # finals of aborts/expiries, returned by step()
        # Prefill role (backend/disagg/prefill.py): called after each update with the sampled
        # choices and the step's deltas; hands first tokens over and drops their deltas.
        self.handoff = None
        # The fused projections' column split for LoRA groups (backend/lora/batch.py); None: LoRA off.
        self._lora_info: dict[str, int] | None = None
        if getattr(runner, "loras", None) is not None:
            cfg = runner.config
            self._lora_info = {"q_size": cfg.num_heads * cfg.head_dim, "kv_size": cfg.num_kv_heads * cfg.head_dim,
                               "intermediate": cfg.intermediate_size}

    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    # -- admission -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    *, stream: bool = True, salt: str | None = None, priority: int = 0,
                    deadline: float | None = None, arrival_time: float | None = None,
                    pooling: PoolingParams | None = None) -> None:
        """Queue a request. ``deadline`` is a time.monotonic() instant. Raises EngineError:
        invalid_request (with ``param``) or queue_full when ``max_waiting`` sequences wait.
        ``pooling`` makes it an embedding request (``params`` ignored): its one final delta
        carries ``embedding``."""
        prompt_token_ids = list(prompt_token_ids)
        resolved = None
        if pooling is not None:
            resolved = validate_embed(self.limits, self.pooling_config, request_id, prompt_token_ids, pooling)
            params, max_tokens, grammar = SamplingParams(speculative=False), 0, None
        else:
            max_tokens = validate_request(self.limits, request_id, prompt_token_ids, params)
            grammar = self.grammars.prepare(params) if params is not None and params.constrained else None
        if request_id in self.scheduler.requests:
            raise duplicate_id(request_id)
        try:
            check_queue(self.limits, self.scheduler.num_waiting)
        except EngineError:
            self.stats_recorder.record_rejected()
            raise
        lora = self._resolve_lora(params.lora if params is not None else None)
        if lora is not None:                   # its KV is its own: the adapter joins the cache key
            salt = extra_key(salt, lora.uid)
        self.scheduler.add_request(Request(
            request_id, prompt_token_ids, params or SamplingParams(), max_tokens=max_tokens, stream=stream,
            salt=salt, priority=int(priority), deadline=deadline, grammar=grammar, pooling=resolved, lora=lora,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time))

    def _resolve_lora(self, name: str | None) -> LoRAAdapter | None:
        """The request's LoRAAdapter (loaded now if evicted), or None for the base model."""
        if name is None:
            return None
        registry = getattr(self.runner, "loras", None)
        if registry is None:
            raise invalid_request("lora", f"LoRA adapter {name!r} requested but LoRA is off (engine option max_loras)")
        busy = {r.lora.name for r in self.scheduler.requests.values() if r.lora is not None}
        try:
            adapter: LoRAAdapter = registry.resolve(name, busy)
        except UnknownAdapter:
            raise invalid_request("lora", f"unknown LoRA adapter {name!r}") from None
        except LoRAError as e:
            raise unavailable(f"LoRA adapter {name!r}: {e}") from None
        return adapter

    def abort_request(self, request_id: str) -> bool:
        """Finish a request now (blocks freed on return); its final deltas come from step()."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return False
        self.stats_recorder.record_aborted()
        self._finish_request(req, "abort", None)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.requests) or bool(self._finals)

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[StepDelta]:
        """One iteration of continuous batching; returns every choice's delta (finals included)."""
        self._expire_deadlines()
        deltas, self._finals = self._finals, []
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)     # draft tokens for this step
        out = self.scheduler.schedule()
        self.stats_recorder.record_schedule(out)
        if out.scheduled:
            tokens, logprobs, pooled = self._run(out)
            outcome = self.scheduler.update_from_output(out, tokens, logprobs)
            self.stats_recorder.record_step(outcome)
            deltas += make_deltas(outcome.sampled, self.stop_checker)
            if self.handoff is not None:                         # prefill role (backend/disagg)
                deltas = self.handoff(outcome.sampled, deltas)
            for seq in pooled:                 # embeddings done: blocks freed now, one final each
                self.stats_recorder.record_finished(self.scheduler.finish_request(seq.request, "stop", None))
                deltas.append(embedding_delta(seq))
        if self.speculator is not None:
            self.speculator.release(self.scheduler.running)     # drafts' state of ended sequences
        return deltas

    def _run(self, out: SchedulerOutput) -> tuple[SampledTokens, SampledLogprobs, list[Sequence]]:
        """Forward pass + sampling (with drafts scheduled, exact verification instead); returns
        tokens, logprobs and the embedding sequences that finished pooling this step."""
        t0 = time.perf_counter()
        batch = build_batch(out.scheduled, self.kv, self.device, self._lora_info)
        pooled: list[Sequence] = []
        if batch.hidden_indices is None:
            logits = self.runner.execute(batch)
        else:                                  # embedding requests in the step (embedding.py)
            logits, hidden = self.runner.execute_pooled(batch)
            pooled = absorb(out.scheduled, hidden)
        if self.speculator is not None and out.num_batched_tokens == len(out.sampling) + out.num_drafts:
            self.speculator.observe(out.num_drafts > 0, time.perf_counter() - t0)   # decode-only step cost
        if out.num_drafts:
            assert out.logit_rows is not None, "plan_sampling names the drafts' rows"
            return (*verify(self.sampler, logits, out.sampling, out.logit_rows), pooled)
        return (*self.sampler(logits, out.sampling, rows=out.logit_rows), pooled)

    # -- ending requests early -------------------------------------------------------------
    def _finish_request(self, req: Request, reason: str, error: EngineError | None) -> None:
        """Abort / expire / fail a request's open choices; their finals go to the next step()."""
        done = self.scheduler.finish_request(req, reason, error)
        self.stats_recorder.record_finished(done)
        if self.speculator is not None:
            self.speculator.release(self.scheduler.running)
        self._finals += make_deltas(done, self.stop_checker)

    def _expire_deadlines(self) -> None:
        for req in self.scheduler.expired(time.monotonic()):
            self.stats_recorder.record_deadline_exceeded()
            self._finish_request(req, "abort", deadline_exceeded())

    def fail_all(self, error: EngineError) -> list[StepDelta]:
        """Finish every open request with finish_reason "error" (the engine loop crashed)."""
        assert error.kind in (ErrorKind.INTERNAL, ErrorKind.UNAVAILABLE), error
        for req in list(self.scheduler.requests.values()):
            try:
                self._finish_request(req, "error", error)
            except Exception:          # the KV state may be what broke; still tell the client
                self.scheduler.requests.pop(req.request_id, None)
        deltas, self._finals = self._finals, []
        return deltas

    def stats(self) -> EngineStats:
        stats = self.stats_recorder.snapshot(self.scheduler, self.kv)
        if self.speculator is not None:
            stats.spec_method = self.speculator.method
        return stats
