"""Stop conditions, checked after each sampled token (vLLM order).

1. a stop token: any EOS id (unless ``ignore_eos``) or ``stop_token_ids`` -> "stop";
   the token stays in ``token_ids`` but its text is cut from the output text;
2. a ``stop`` string (OpenAI semantics: the string and everything after it is not output);
3. ``max_tokens`` or the context limit -> "length".
Nothing stops before ``min_tokens`` output tokens (the sampler masks stop tokens until then).

Stop strings need text, so only requests that have them are detokenized, with the same windowed
decode the postprocessing step uses (backend/detokenizer.py). Output text that could still begin
a stop string is *held*: its tokens are not marked ready, so no stream ever shows part of a stop
string. Because held text always covers every possible match start, a match lies entirely in
the text of tokens [num_ready:], and ``stop_at`` is its offset there.

What became ready is what a stream may see: ``make_deltas`` turns each sequence's progress since
its last delta into a ``StepDelta``. A streamed choice gets one whenever tokens became ready; a
non-streamed one only its final. ``window_ids`` / ``num_sent`` feed the stateless detokenizer,
``max_chars`` cuts the final text where a stop string or token matched.
"""
from __future__ import annotations

from typing import Any

from backend.detokenizer import decode_delta, window_start
from backend.engine.sequence import Sequence
from backend.outputs import StepDelta


class StopChecker:
    def __init__(self, tokenizer: Any, eos_token_ids: list[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())

    def check(self, seq: Sequence, token: int) -> None:
        """Sets seq.finish_reason (and cut state) if ``token`` (just appended) ends the choice,
        and advances seq.num_ready past tokens that can no longer begin a stop string."""
        p = seq.params
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens and ((token in self.eos_token_ids and not p.ignore_eos)
                                      or token in p.stop_token_ids):
            seq.finish_reason = "stop"
            seq.cut_last_token = not (p.skip_special_tokens and token in self.special_ids)
            return
        if p.stop and self.tokenizer is not None:
            if n_out < p.min_tokens:
                seq.num_ready = n_out            # stop strings do not apply yet: nothing to hold
            elif self._scan_stop_strings(seq):
                seq.finish_reason = "stop"
                return
        else:
            seq.num_ready = n_out
        if n_out >= seq.request.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    def _decode(self, window: list[int], num_sent: int, skip: bool) -> str:
        return decode_delta(self.tokenizer, window, num_sent, skip_special_tokens=skip)

    def _scan_stop_strings(self, seq: Sequence) -> bool:
        stops, skip = seq.params.stop, seq.params.skip_special_tokens
        ws = window_start(seq.num_ready)
        window = seq.output_slice(ws)
        k = seq.num_ready - ws
        text = self._decode(window, k, skip)
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            seq.stop_at = min(hits)
            return True
        hold = held_chars(text, stops)
        if hold == 0:
            seq.num_ready = seq.num_output_tokens
            return False
        keep = len(text) - hold
        j = len(window) - k - 1                  # the last token is held for sure
        while j > 0 and len(self._decode(window[:k + j], k, skip)) > keep:
            j -= 1
        seq.num_ready += j
        return False

    def chars_before_cut(self, seq: Sequence) -> int:
        """``max_chars`` for the final delta of a stopped sequence (text from num_sent on)."""
        skip = seq.params.skip_special_tokens
        ws = window_start(seq.num_sent)
        k = seq.num_sent - ws
        if seq.stop_at >= 0:
            before = 0
            if seq.num_ready > seq.num_sent:      # non-stream: ready text was not sent yet
                before = len(self._decode(seq.output_slice(ws, seq.num_ready), k, skip))
            return before + seq.stop_at
        if seq.cut_last_token and self.tokenizer is not None:
            window = seq.output_slice(ws, seq.num_output_tokens - 1)
            return len(decode_delta(self.tokenizer, window, k, final=True, skip_special_tokens=skip))
        return -1


def held_chars(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


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
