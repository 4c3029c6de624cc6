"""StepDeltas: what a sequence's progress since its last delta looks like to the server.

A streamed choice gets a delta whenever tokens became *ready* (they cannot begin a stop string);
a non-streamed one only its final. ``window_ids`` / ``num_sent`` feed the stateless detokenizer
(backend/detokenizer.py), ``max_chars`` cuts the final text where a stop string or token matched.
"""
from __future__ import annotations

from backend.detokenizer import window_start
from backend.engine.sequence import Sequence
from backend.engine.stop_checker import StopChecker
from backend.outputs import StepDelta


def make_delta(seq: Sequence, stop_checker: StopChecker) -> StepDelta | None:
    """The delta of ``seq`` since the last one (None when there is nothing to send yet)."""
    req = seq.request
    finished = seq.finish_reason is not None
    if not finished and (not req.stream or seq.num_ready == seq.num_sent):
        return None
    end = seq.num_output_tokens if finished else seq.num_ready
    ws = window_start(seq.num_sent)
    delta = StepDelta(
        request_id=req.request_id, index=seq.index,
        new_token_ids=seq.output_slice(seq.num_sent, end), window_ids=seq.output_slice(ws, end),
        num_sent=seq.num_sent - ws, max_chars=stop_checker.chars_before_cut(seq) if finished else -1,
        finished=finished, finish_reason=seq.finish_reason, error=seq.error,
        logprobs=seq.logprobs[seq.num_sent:end] if seq.logprobs else [],
        prompt_tokens=seq.num_prompt_tokens, completion_tokens=seq.num_output_tokens,
        cached_tokens=req.num_cached_tokens, queue_time=req.queue_time,
        num_preemptions=seq.num_preemptions, spec_drafted_tokens=seq.num_drafted,
        spec_accepted_tokens=seq.num_accepted, spec_steps=seq.num_spec_steps)
    seq.num_sent = end
    return delta


def make_deltas(seqs: list[Sequence], stop_checker: StopChecker) -> list[StepDelta]:
    return [d for d in (make_delta(s, stop_checker) for s in seqs) if d is not None]
