"""What the engine hands back, and how a step decides what may be shown.

- **Types**: ``StepDelta`` (one choice's progress in one step: what the server streams), the
  offline API's finished results, ``STOP``.
- **Incremental detokenization** (:func:`decode_delta`): the text of a delta, computed the same way
  by the engine (stop strings) and by the response thread (``text_output``).
- **Stop conditions** (:class:`StopChecker`) and the deltas (:func:`make_deltas`): which sampled
  tokens end a choice and which are ready to stream.

Incremental detokenization
--------------------------
Stateless incremental detokenization over a short window of token ids.

Each streamed response carries ``window_ids`` = a few already-sent tokens for context followed by
the new ones, and ``num_sent`` = how many of the window were already sent. The delta is::

    emitted(k) = decode(window[:j]) for the largest j in [k - 3, k] whose text does not end in
                 U+FFFD (an incomplete character), else the longest common prefix of
                 decode(window[:j]) over j in [k - 3, k]
    delta      = emitted(len(window))[len(emitted(num_sent)):]

Holding back whole tokens, at most three, rather than trailing U+FFFD characters matters: invalid
bytes make permanent U+FFFD, and a run of them must not be held forever. A UTF-8 character has at
most 4 bytes, so three tokens (three bytes or more) after window[:k - 3] whatever character its
text ended in is settled: completed (then the later decodes no longer agree on that U+FFFD and the
common prefix stops before it) or invalid for good (then all four agree and it is emitted). Taking
decode(window[:k - 3]) itself there would emit the U+FFFD of a character that the next tokens
complete (bytes e9 80 | ae b5 | ae b5 | ae b5: "\ufffd" then "逮\ufffd..."), and the stream would
no longer equal decode(all ids).

Both decodes start at the same token, so whatever the first token does to the text (a partial
character, a stripped leading space) cancels out. On the final response a trailing U+FFFD is kept,
since decode(all ids) keeps it too. The engine and the postprocessing model call the same
functions, so a stop-string cut computed by the engine lands on the same characters.

Stop conditions
---------------
Stop conditions, checked after each sampled token (vLLM order).

1. a stop token: any EOS id (unless ``ignore_eos``) or ``stop_token_ids`` -> "stop";
   the token stays in ``token_ids`` but its text is cut from the output text;
2. a ``stop`` string (OpenAI semantics: the string and everything after it is not output);
3. ``max_tokens`` or the context limit -> "length".
Nothing stops before ``min_tokens`` output tokens (the sampler masks stop tokens until then).

Stop strings need text, so only requests that have them are detokenized, with the same windowed
decode the postprocessing step uses (:func:`decode_delta`). Output text that could still begin
a stop string is *held*: its tokens are not marked ready, so no stream ever shows part of a stop
string. Because held text always covers every possible match start, a match lies entirely in
the text of tokens [num_ready:], and ``stop_at`` is its offset there.

What became ready is what a stream may see: ``make_deltas`` turns each sequence's progress since
its last delta into a ``StepDelta``. A streamed choice gets one whenever tokens became ready; a
non-streamed one only its final. ``window_ids`` / ``num_sent`` feed the stateless detokenizer,
``max_chars`` cuts the final text where a stop string or token matched.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from backend.errors import EngineError

if TYPE_CHECKING:
    from backend.engine.sequence import Sequence


class Stop:
    """The one sentinel that ends every queue-draining thread (engine intake, responses, metrics)."""

    def __repr__(self) -> str:
        return "STOP"


STOP = Stop()


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class StepDelta:
    """One request choice's progress in one engine step (what the server streams).

    ``window_ids`` / ``num_sent`` feed the stateless detokenizer (:func:`decode_delta` below):
    the text delta is decode(window_ids) minus decode(window_ids[:num_sent]), cut to
    ``max_chars`` characters when a stop string matched. Tokens whose text could still begin a
    stop string are held back by the engine and appear in a later delta.
    """
    request_id: str
    index: int                              # choice index (n > 1)
    new_token_ids: list[int]
    window_ids: list[int]
    num_sent: int
    max_chars: int = -1                     # -1 = no cut
    finished: bool = False
    finish_reason: str | None = None        # "stop" | "length" | "abort" | "error"
    # Why the engine ended the choice, set only then: kind deadline with finish_reason "abort"
    # (the request's deadline passed); internal / unavailable with "error" (the engine failed).
    error: EngineError | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_time: float = 0.0                 # seconds from arrival to first schedule
    num_preemptions: int = 0
    # speculative decoding, cumulative for the choice: drafts verified / accepted, and the steps
    # that verified drafts (accepted tokens per step = spec_accepted_tokens / spec_steps)
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_steps: int = 0
    embedding: list[float] | None = None    # an embedding request's vector (its one, final delta)


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    num_cached_tokens: int
    outputs: list[CompletionOutput]
    finished: bool = True


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """``LLM.embed`` results (vLLM's shape: ``out.outputs.embedding``)."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


# Incremental detokenization. At most MAX_HELD_TOKENS tokens are ever held back; the window reaches further back than that so
# both decodes share a clean start (a character is at most 4 bytes).
MAX_HELD_TOKENS = 3
CONTEXT_TOKENS = 6
REPLACEMENT = "\ufffd"


def window_start(num_emitted: int) -> int:
    """Index of the first token of the window for a sequence whose first num_emitted tokens were sent."""
    return max(0, num_emitted - CONTEXT_TOKENS)


def _decode(tokenizer: Any, ids: list[int], skip_special_tokens: bool) -> str:
    text: str = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                 clean_up_tokenization_spaces=False)
    return text


def _emitted(tokenizer: Any, ids: list[int], final: bool, skip_special_tokens: bool) -> str:
    text = _decode(tokenizer, ids, skip_special_tokens)
    if final or not text.endswith(REPLACEMENT):
        return text
    texts = [text]
    for cut in range(1, min(MAX_HELD_TOKENS, len(ids)) + 1):
        text = _decode(tokenizer, ids[:len(ids) - cut], skip_special_tokens)
        if not text.endswith(REPLACEMENT):
            return text
        texts.append(text)
    return os.path.commonprefix(texts)


def decode_delta(tokenizer: Any, window_ids: list[int], num_sent: int, *, final: bool = False,
                 max_chars: int = -1, skip_special_tokens: bool = True) -> str:
    """Text of window_ids[num_sent:] given window_ids[:num_sent] was already emitted."""
    before = _emitted(tokenizer, window_ids[:num_sent], False, skip_special_tokens)
    after = _emitted(tokenizer, window_ids, final, skip_special_tokens)
    delta = after[len(before):]
    return delta if max_chars < 0 else delta[:max_chars]


# Stop conditions.
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
