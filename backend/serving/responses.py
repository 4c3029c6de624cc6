"""StepDelta -> the engine model's output tensors (numpy): names, dtypes and dims are
backend/protocol.py's ENGINE_OUTPUTS, in that order; only the names the caller requested are built
(the ``llm`` ensemble asks for nine of the thirteen, so a streamed token costs nine small arrays).

    logprobs       JSON [{"id","logprob","top":[[id,logprob],...]}] or ""
    metrics        JSON {"queue_time","ttft","num_preemptions"} on the final response, else ""
    text_output    the text delta (backend/detokenizer.py, computed by the response thread)
    text_logprobs  logprobs in OpenAI's chat shape (backend/serving/postprocess.py) or ""
"""
from __future__ import annotations

import json
from typing import Collection

import numpy as np

from backend import protocol as P
from backend.outputs import StepDelta
from backend.serving.tensors import string_array

_INT32 = np.int32
_EMPTY = np.array([b""], dtype=np.object_)      # never written to by the stubs (they copy inputs)
TEXT_NAMES = frozenset((P.TEXT_OUTPUT, P.TEXT_LOGPROBS))


def _int1(v: int) -> np.ndarray:
    return np.array((v,), dtype=_INT32)


def _str1(text: str) -> np.ndarray:
    return string_array(text) if text else _EMPTY


def logprobs_json(delta: StepDelta) -> str:
    if not delta.logprobs:
        return ""
    return json.dumps([{"id": lp.token_id, "logprob": float(lp.logprob),
                        "top": [[int(t), float(v)] for t, v in lp.top]} for lp in delta.logprobs])


def finish_reason_of(delta: StepDelta) -> str:
    """The wire finish_reason: "" until the choice finished."""
    return (delta.finish_reason or "") if delta.finished else ""


def wants_text(want: Collection[str] | None) -> bool:
    """Whether a caller that requested ``want`` (None: everything) needs the detokenizer."""
    return want is None or not TEXT_NAMES.isdisjoint(want)


def engine_outputs(delta: StepDelta, *, ttft: float | None = None, text: tuple[str, str] | None = None,
                   want: Collection[str] | None = None) -> dict[str, np.ndarray]:
    """The response tensors of one delta. ``text`` = (text delta, OpenAI logprobs JSON) when the
    response thread detokenized it (else those two outputs are left out); ``want`` = the output
    names the caller requested (None: all)."""
    metrics = ""
    if delta.finished:
        m = {"queue_time": round(delta.queue_time, 6), "ttft": None if ttft is None else round(ttft, 6),
             "num_preemptions": delta.num_preemptions}
        record = getattr(delta, "handover", None)       # prefill role: backend/serving/disagg_engine.py
        if record is not None:
            m[P.HANDOVER] = record
        metrics = json.dumps(m)
    out: dict[str, np.ndarray] = {}
    w = want
    if w is None or P.OUTPUT_IDS in w:
        out[P.OUTPUT_IDS] = np.array(delta.new_token_ids, dtype=_INT32)
    if w is None or P.WINDOW_IDS in w:
        out[P.WINDOW_IDS] = np.array(delta.window_ids, dtype=_INT32)
    if w is None or P.NUM_SENT in w:
        out[P.NUM_SENT] = _int1(delta.num_sent)
    if w is None or P.MAX_CHARS in w:
        out[P.MAX_CHARS] = _int1(delta.max_chars)
    if w is None or P.FINISH_REASON in w:
        out[P.FINISH_REASON] = _str1(finish_reason_of(delta))
    if w is None or P.INDEX in w:
        out[P.INDEX] = _int1(delta.index)
    if w is None or P.PROMPT_TOKENS in w:
        out[P.PROMPT_TOKENS] = _int1(delta.prompt_tokens)
    if w is None or P.COMPLETION_TOKENS in w:
        out[P.COMPLETION_TOKENS] = _int1(delta.completion_tokens)
    if w is None or P.CACHED_TOKENS in w:
        out[P.CACHED_TOKENS] = _int1(delta.cached_tokens)
    if w is None or P.LOGPROBS in w:
        out[P.LOGPROBS] = _str1(logprobs_json(delta))
    if w is None or P.METRICS in w:
        out[P.METRICS] = _str1(metrics)
    if text is not None:
        if w is None or P.TEXT_OUTPUT in w:
            out[P.TEXT_OUTPUT] = _str1(text[0])
        if w is None or P.TEXT_LOGPROBS in w:
            out[P.TEXT_LOGPROBS] = _str1(text[1])
    return out


def control_outputs(stopped: bool) -> dict[str, np.ndarray]:
    """The answer to an abort control request: finish_reason "abort" if a request was stopped."""
    return {P.FINISH_REASON: string_array("abort" if stopped else ""), P.INDEX: _int1(0)}
