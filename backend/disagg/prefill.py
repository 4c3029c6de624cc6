"""Prefill role: the engine computes a prompt (prefix caching and chunking as usual), samples
the first token, and hands the request over instead of decoding it.

``PrefillRole(engine, connector)`` installs itself as the engine's ``handoff`` hook, which
LLMEngine.step calls after each step's update. For every choice that just got its first token
and is not finished, the hook reads the prompt's KV blocks, stages them on the connector,
builds a :class:`Handover` record, and finishes the request on this engine (its blocks are free
on return; the client-facing delta of that token is suppressed: the decode engine emits it, so
the client sees one stream). Records wait in ``outbox`` for the router.

Not handed over (they finish here, as on a unified engine): n > 1, structured outputs and
logit_bias (their state is not plain data), and a first token that already ends the request.
If staging fails the record still goes out with ``locator=None``: the decode side recomputes.
"""
from __future__ import annotations

import time

from backend.disagg.connector import KVConnector
from backend.disagg.handover import Handover, dtype_name, generator_state, params_to_dict
from backend.engine.sequence import Sequence
from backend.outputs import StepDelta


class PrefillRole:
    def __init__(self, engine, connector: KVConnector):
        self.engine = engine
        self.connector = connector
        self.outbox: list[Handover] = []
        self.handed_over = 0
        self.kept = 0                         # requests this engine finished itself
        self.staging_failures = 0
        self.started: dict[str, float] = {}   # request id -> perf_counter() when its hand-over began
        # request id -> locator of what it staged, so an abort that reaches this engine after the
        # hand-over still releases the staged KV (entries go with release(), or the TTL's forget())
        self.staged: dict[str, tuple[dict, float]] = {}
        engine.handoff = self

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        req = seq.request
        return (seq.num_output_tokens == 1 and seq.finish_reason is None and req.params.n == 1
                and req.grammar is None and req.params.structured is None and not req.params.logit_bias)

    def __call__(self, sampled: list[Sequence], deltas: list[StepDelta]) -> list[StepDelta]:
        """The engine hook: hand over what can go, return the deltas the client should still see."""
        gone = set()
        for seq in sampled:
            if seq.num_output_tokens != 1 or seq.finish_reason is not None:
                continue
            if not self.eligible(seq):
                self.kept += seq.index == 0       # requests, not choices
                continue
            self.outbox.append(self._hand_over(seq))
            gone.add(seq.request.request_id)
        return [d for d in deltas if d.request_id not in gone] if gone else deltas

    def _hand_over(self, seq: Sequence) -> Handover:
        eng, req = self.engine, seq.request
        self.started[req.request_id] = time.perf_counter()
        storage = eng.kv.storage
        n_kv = seq.num_prompt_tokens
        bs = eng.kv.block_size
        block_ids = eng.kv.block_table(seq.seq_id)[:-(-n_kv // bs)]
        locator = None
        try:
            # a fresh random transfer id; only a request with this request's salt may fetch it
            locator = self.connector.stage(storage.read_blocks(block_ids), owner=req.salt)
        except Exception:                     # full staging area, /dev/shm full...: decode recomputes
            self.staging_failures += 1
        lp = seq.logprobs[0] if seq.logprobs else None
        rec = Handover(
            request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids), first_token=seq.token_ids[-1],
            params=params_to_dict(req.params), max_tokens=req.max_tokens, num_kv_tokens=n_kv, block_size=bs,
            block_shape=list(storage.block_shape), dtype=dtype_name(storage.dtype), locator=locator,
            stream=req.stream,
            deadline_in=None if req.deadline is None else req.deadline - time.monotonic(),
            queue_time=req.queue_time, num_cached_tokens=req.num_cached_tokens,
            first_logprob=None if lp is None else [lp.token_id, lp.logprob, [list(t) for t in lp.top]],
            generator_state=generator_state(seq.generator),
            extra={"staged_at": time.time()})      # wall clock: the decode side's hand-over latency
        if locator is not None:
            self.staged[req.request_id] = (locator, time.monotonic())
        eng.scheduler.finish_request(req, "handover", None)   # blocks free on return; no final delta
        self.handed_over += 1
        return rec

    def release(self, request_id: str) -> bool:
        """An abort of a request already handed over: drop its staged KV (harmless if the decode
        side fetched it already). True if this engine had handed it over."""
        entry = self.staged.pop(request_id, None)
        if entry is None:
            return False
        self.connector.release(entry[0])
        return True

    def forget(self, ttl: float) -> None:
        """Drop the bookkeeping of hand-overs staged more than ``ttl`` seconds ago (the
        connector's TTL has dropped their KV by then, or the decode side fetched it)."""
        cut = time.monotonic() - ttl
        for rid, (_, t) in list(self.staged.items()):
            if t < cut:
                self.staged.pop(rid, None)

    def take(self) -> list[Handover]:
        out, self.outbox = self.outbox, []
        return out
