"""StepDelta -> the engine model's output tensors (numpy), as listed in docs/architecture.md.

    output_ids  INT32[-1]  the delta's token ids      window_ids INT32[-1]  context + new ids
    num_sent    INT32[1]   ids of the window sent      max_chars  INT32[1]   stop-string cut (-1: none)
    finish_reason BYTES[1] "" | stop | length | abort  index      INT32[1]   the choice
    prompt_tokens / completion_tokens / cached_tokens INT32[1]
    logprobs    BYTES[1]   JSON [{"id","logprob","top":[[id,logprob],...]}] or ""
    metrics     BYTES[1]   JSON {"queue_time","ttft","num_preemptions"} on the final response, else ""
"""
from __future__ import annotations

import json

import numpy as np

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
        metrics = json.dumps({"queue_time": round(delta.queue_time, 6),
                              "ttft": None if ttft is None else round(ttft, 6),
                              "num_preemptions": delta.num_preemptions})
    return {
        "output_ids": int_array(delta.new_token_ids),
        "window_ids": int_array(delta.window_ids),
        "num_sent": _int1(delta.num_sent),
        "max_chars": _int1(delta.max_chars),
        "finish_reason": string_array(delta.finish_reason or "" if delta.finished else ""),
        "index": _int1(delta.index),
        "prompt_tokens": _int1(delta.prompt_tokens),
        "completion_tokens": _int1(delta.completion_tokens),
        "cached_tokens": _int1(delta.cached_tokens),
        "logprobs": string_array(logprobs_json(delta)),
        "metrics": string_array(metrics),
    }


def control_outputs(stopped: bool) -> dict[str, np.ndarray]:
    """The answer to an abort control request: finish_reason "abort" if a request was stopped."""
    return {"finish_reason": string_array("abort" if stopped else ""), "index": _int1(0)}
