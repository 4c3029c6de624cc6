"""StepDelta -> the engine model's output tensors (numpy): names, dtypes and dims are
backend/protocol.py's ENGINE_OUTPUTS, in that order; only the names the caller requested are built
(the ``llm`` ensemble asks for nine of the thirteen, so a streamed token costs nine small arrays).

    logprobs       JSON [{"id","logprob","top":[[id,logprob],...]}] or ""
    metrics        JSON {"queue_time","ttft","num_preemptions"} on the final response, else ""
    text_output    the text delta (backend/detokenizer.py, computed by the response thread)
    text_logprobs  logprobs in OpenAI's chat shape (backend/serving/postprocess.py) or ""
    embedding      an embedding request's vector, FP32 (empty for generations)
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
_NO_VECTOR = np.zeros((0,), dtype=np.float32)
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


def metrics_json(delta: StepDelta, ttft: float | None) -> str:
    """The final response's metrics (plus the hand-over record of a prefill-role engine), else ""."""
    if not delta.finished:
        return ""
    m = {"queue_time": round(delta.queue_time, 6), "ttft": None if ttft is None else round(ttft, 6),
         "num_preemptions": delta.num_preemptions}
    record = getattr(delta, "handover", None)       # prefill role: backend/serving/disagg_engine.py
    if record is not None:
        m[P.HANDOVER] = record
    return json.dumps(m)


# output name -> builder(delta, ttft), in ENGINE_OUTPUTS order (the text outputs come from the caller)
_BUILDERS = (
    (P.OUTPUT_IDS, lambda d, t: np.array(d.new_token_ids, dtype=_INT32)),
    (P.WINDOW_IDS, lambda d, t: np.array(d.window_ids, dtype=_INT32)),
    (P.NUM_SENT, lambda d, t: _int1(d.num_sent)),
    (P.MAX_CHARS, lambda d, t: _int1(d.max_chars)),
    (P.FINISH_REASON, lambda d, t: _str1(finish_reason_of(d))),
    (P.INDEX, lambda d, t: _int1(d.index)),
    (P.PROMPT_TOKENS, lambda d, t: _int1(d.prompt_tokens)),
    (P.COMPLETION_TOKENS, lambda d, t: _int1(d.completion_tokens)),
    (P.CACHED_TOKENS, lambda d, t: _int1(d.cached_tokens)),
    (P.LOGPROBS, lambda d, t: _str1(logprobs_json(d))),
    (P.METRICS, lambda d, t: _str1(metrics_json(d, t))),
)


def engine_outputs(delta: StepDelta, *, ttft: float | None = None, text: tuple[str, str] | None = None,
                   want: Collection[str] | None = None) -> dict[str, np.ndarray]:
    """The response tensors of one delta. ``text`` = (text delta, OpenAI logprobs JSON) when the
    response thread detokenized it (else those two outputs are left out); ``want`` = the output
    names the caller requested (None: all)."""
    out = {name: build(delta, ttft) for name, build in _BUILDERS if want is None or name in want}
    if text is not None:
        for name, value in ((P.TEXT_OUTPUT, text[0]), (P.TEXT_LOGPROBS, text[1])):
            if want is None or name in want:
                out[name] = _str1(value)
    if want is None or P.EMBEDDING in want:
        out[P.EMBEDDING] = _NO_VECTOR if delta.embedding is None else np.asarray(delta.embedding, dtype=np.float32)
    return out


def control_outputs(stopped: bool) -> dict[str, np.ndarray]:
    """The answer to an abort control request: finish_reason "abort" if a request was stopped."""
    return {P.FINISH_REASON: string_array("abort" if stopped else ""), P.INDEX: _int1(0)}
