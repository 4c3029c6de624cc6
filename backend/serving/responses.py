"""StepDelta -> the engine model's output tensors (numpy): names, dtypes and dims are
backend/protocol.py's ENGINE_OUTPUTS, in that order.

    logprobs    JSON [{"id","logprob","top":[[id,logprob],...]}] or ""
    metrics     JSON {"queue_time","ttft","num_preemptions"} on the final response, else ""
"""
from __future__ import annotations

import json

import numpy as np

from backend import protocol as P
from backend.outputs import StepDelta
from backend.serving.tensors import int_array, string_array


def _int1(v: int) -> np.ndarray:
    return np.array([int(v)], dtype=np.int32)


def logprobs_json(delta: StepDelta) -> str:
    if not delta.logprobs:
        return ""
    return json.dumps([{"id": lp.token_id, "logprob": float(lp.logprob),
                        "top": [[int(t), float(v)] for t, v in lp.top]} for lp in delta.logprobs])


def engine_outputs(delta: StepDelta, *, ttft: float | None = None) -> dict[str, np.ndarray]:
    metrics = ""
    if delta.finished:
        m = {"queue_time": round(delta.queue_time, 6), "ttft": None if ttft is None else round(ttft, 6),
             "num_preemptions": delta.num_preemptions}
        record = getattr(delta, "handover", None)       # prefill role: backend/serving/disagg_engine.py
        if record is not None:
            m[P.HANDOVER] = record
        metrics = json.dumps(m)
    return {
        P.OUTPUT_IDS: int_array(delta.new_token_ids),
        P.WINDOW_IDS: int_array(delta.window_ids),
        P.NUM_SENT: _int1(delta.num_sent),
        P.MAX_CHARS: _int1(delta.max_chars),
        P.FINISH_REASON: string_array(delta.finish_reason or "" if delta.finished else ""),
        P.INDEX: _int1(delta.index),
        P.PROMPT_TOKENS: _int1(delta.prompt_tokens),
        P.COMPLETION_TOKENS: _int1(delta.completion_tokens),
        P.CACHED_TOKENS: _int1(delta.cached_tokens),
        P.LOGPROBS: string_array(logprobs_json(delta)),
        P.METRICS: string_array(metrics),
    }


def control_outputs(stopped: bool) -> dict[str, np.ndarray]:
    """The answer to an abort control request: finish_reason "abort" if a request was stopped."""
    return {P.FINISH_REASON: string_array("abort" if stopped else ""), P.INDEX: _int1(0)}
