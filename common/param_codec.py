"""The request-parameter codec: every parameter a request may carry, its type, how a client writes
it (:func:`encode`) and how the server reads it (:func:`decode`, once, in the engine's intake).

Triton carries a request's parameters as a JSON object of strings, integers, floats and booleans,
so lists and objects travel as JSON text. The names are OpenAI's (vLLM's for ``guided_*``);
backend/protocol.py re-exports them. :func:`decode` checks each value's *type* and the bounds the
wire or the server's own bookkeeping needs (int64, priority, timeout, name lengths) and raises
:class:`ParamError` naming the parameter; value ranges are ``SamplingParams``' job (backend).
Unknown parameters are ignored, like unknown fields of an OpenAI request. Structured-output fields
are kept as given (``RequestParams.structured``, empty unless the request asked for one): only
such requests pay for parsing them (backend/structured/spec.py).

Triton's front ends consume parameters named ``priority`` and ``timeout`` themselves (they never
reach a model), so a client's ``priority`` / ``timeout`` are written as ``request_priority`` /
``request_timeout`` (the plain names are still read should they arrive).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from common.env import parse_bool

STREAM = "stream"
N = "n"
MAX_TOKENS = "max_tokens"
MAX_COMPLETION_TOKENS = "max_completion_tokens"   # OpenAI's newer name for max_tokens
MIN_TOKENS = "min_tokens"
TEMPERATURE = "temperature"
TOP_P = "top_p"
TOP_K = "top_k"
MIN_P = "min_p"
SEED = "seed"
PRESENCE_PENALTY = "presence_penalty"
FREQUENCY_PENALTY = "frequency_penalty"
REPETITION_PENALTY = "repetition_penalty"
STOP = "stop"                       # JSON list of strings (or one string)
STOP_TOKEN_IDS = "stop_token_ids"   # JSON list of ints
IGNORE_EOS = "ignore_eos"
SKIP_SPECIAL_TOKENS = "skip_special_tokens"
SPECULATIVE = "speculative"         # false: this request never speculates (with speculative_config set)
LOGPROBS_PARAM = "logprobs"         # bool (chat) or int (completions); same name as the tensor
TOP_LOGPROBS = "top_logprobs"
TENANT = "tenant"                   # salts the prefix cache: tenants never share cached blocks
REQUEST_PRIORITY = "request_priority"   # lower = sooner
REQUEST_TIMEOUT = "request_timeout"     # seconds from arrival
PLAIN_PRIORITY, PLAIN_TIMEOUT = "priority", "timeout"
ABORT_REQUEST_ID = "abort_request_id"   # a control request to the engine: stop that request
                                        # (only a request of the same tenant)
CACHE_SALT = "cache_salt"           # honoured only with the engine option allow_client_salt
LORA = "lora"                       # a LoRA adapter's name (docs/lora.md); absent = the base model
LORA_ADMIN = "lora_admin"           # a control request to the engine: JSON {"action": "load" | "unload",
                                    # "lora_name", "lora_path"} (backend/serving/lora_control.py)
HANDOVER = "handover"               # a disaggregated continuation's record (docs/disaggregation.md)
TEST_FAULT = "test_fault"           # tests only: honoured with TRITON_LLM_TEST_FAULTS=1
MAX_TENANT_CHARS = 256
# Structured outputs (backend/structured/spec.py): JSON values as JSON text.
RESPONSE_FORMAT = "response_format"       # OpenAI: {"type": "json_object" | "json_schema", ...}
GUIDED_JSON = "guided_json"               # vLLM's names, for direct Triton clients
GUIDED_REGEX = "guided_regex"
GUIDED_CHOICE = "guided_choice"
GUIDED_GRAMMAR = "guided_grammar"
TOOLS = "tools"                           # OpenAI tools (also rendered by the chat template)
TOOL_CHOICE = "tool_choice"               # "none" | "auto" | "required" | {"type": "function", ...}
PARALLEL_TOOL_CALLS = "parallel_tool_calls"
LOGIT_BIAS = "logit_bias"                 # {"token id": bias in [-100, 100]}
# Embedding requests (engine model, token ids in): EMBED = true makes the request an embedding one.
EMBED = "embed"
DIMENSIONS = "dimensions"                 # Matryoshka models only (backend/model/pooling.py)
NORMALIZE = "normalize"                   # L2-normalize (default: the model's)
STRUCTURED_PARAMS = (RESPONSE_FORMAT, GUIDED_JSON, GUIDED_REGEX, GUIDED_CHOICE, GUIDED_GRAMMAR, TOOLS,
                     TOOL_CHOICE, PARALLEL_TOOL_CALLS)

INT_PARAMS = (N, MAX_TOKENS, MIN_TOKENS, TOP_K, SEED, TOP_LOGPROBS, REQUEST_PRIORITY, DIMENSIONS)
FLOAT_PARAMS = (TEMPERATURE, TOP_P, MIN_P, PRESENCE_PENALTY, FREQUENCY_PENALTY, REPETITION_PENALTY,
                REQUEST_TIMEOUT)
BOOL_PARAMS = (STREAM, IGNORE_EOS, SKIP_SPECIAL_TOKENS, SPECULATIVE, EMBED, NORMALIZE)
LIST_PARAMS = (STOP, STOP_TOKEN_IDS)
# SamplingParams fields set from request parameters of the same name (logprobs is derived).
SAMPLING_PARAMS = (N, MAX_TOKENS, MIN_TOKENS, TEMPERATURE, TOP_P, TOP_K, MIN_P, SEED, PRESENCE_PENALTY,
                   FREQUENCY_PENALTY, REPETITION_PENALTY, STOP, STOP_TOKEN_IDS, IGNORE_EOS,
                   SKIP_SPECIAL_TOKENS, SPECULATIVE)
# Names a client may use that Triton's gRPC front end would consume: sent under the right name.
RENAMED_PARAMS = {PLAIN_PRIORITY: REQUEST_PRIORITY, PLAIN_TIMEOUT: REQUEST_TIMEOUT}
# Reserved by Triton's gRPC front end (tritonclient refuses them or they never reach a model).
RESERVED_PARAMS = ("sequence_id", "sequence_start", "sequence_end", "headers", "binary_data_output")

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1      # what the gRPC message carries
PRIORITY_RANGE = (-1_000_000, 1_000_000)
MAX_TIMEOUT = 24 * 3600.0


class ParamError(ValueError):
    """A parameter the codec cannot write or read; ``param`` names it (the server answers
    ``[invalid_request param=<param>]``, the client raises InvalidRequestError)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class RequestParams:
    """One request's parameters as the server reads them. ``sampling``: the SamplingParams fields
    given (typed), ``structured``: the structured-output fields given (raw), else empty."""
    sampling: dict[str, Any] = field(default_factory=dict)
    logprobs: int | None = None
    lora: str | None = None
    structured: dict[str, Any] = field(default_factory=dict)
    stream: bool = True
    tenant: str | None = None
    priority: int = 0
    timeout: float | None = None
    cache_salt: str | None = None
    embed: bool = False
    dimensions: int | None = None
    normalize: bool | None = None

    @property
    def max_tokens_given(self) -> bool:
        return MAX_TOKENS in self.sampling


# -- the client side ------------------------------------------------------------------------------
def encode(params: dict[str, Any] | None) -> dict[str, str | bool | int | float]:
    """Python values -> Triton request parameters (str/int/float/bool; lists and dicts as JSON,
    numpy scalars as Python ones, None left out). Raises ParamError for an integer outside int64,
    ValueError for a name Triton reserves or a type the wire cannot carry (a caller's bug)."""
    out: dict[str, str | bool | int | float] = {}
    for key, value in (params or {}).items():
        if value is None:
            continue
        key = RENAMED_PARAMS.get(key, key)
        if key in RESERVED_PARAMS or key.startswith("triton_"):
            raise ValueError(f"request parameter {key!r} is reserved by Triton's gRPC front end and "
                                  "would never reach the model")
        if isinstance(value, (list, tuple, dict)):
            value = json.dumps(value)
        elif hasattr(value, "item") and type(value) not in (str, bool, int, float):
            value = value.item()            # a numpy scalar (np.float64 too: a float subclass)
        if not isinstance(value, (str, bool, int, float)):
            raise ValueError(f"request parameter {key!r} has unsupported type {type(value).__name__}")
        if isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX:
            # the gRPC message carries int64; past it protobuf raises a bare ValueError (a 500)
            raise ParamError(key, f"{key} must fit in a signed 64-bit integer, got {value}")
        out[key] = value
    return out


# -- the server side ------------------------------------------------------------------------------
def parse_raw(raw: str | dict[str, Any] | None) -> dict[str, Any]:
    """``request.parameters()`` (a JSON string) -> dict."""
    if raw is None or raw == "":
        return {}
    if isinstance(raw, dict):
        return dict(raw)
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ParamError("parameters", f"request parameters are not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ParamError("parameters", "request parameters must be a JSON object")
    return value


def decode(params: dict[str, Any]) -> RequestParams:
    """Read a request's parameters once; raises ParamError naming the first bad one."""
    p = {k: v for k, v in params.items() if v is not None}
    if MAX_TOKENS not in p and MAX_COMPLETION_TOKENS in p:
        p[MAX_TOKENS] = p[MAX_COMPLETION_TOKENS]
    out = RequestParams(sampling={name: read(name, p[name]) for name in SAMPLING_PARAMS if name in p})
    for t in out.sampling.get(STOP_TOKEN_IDS, ()):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= INT64_MAX:
            raise ParamError(STOP_TOKEN_IDS, "stop_token_ids must be non-negative integers")
    out.logprobs = _logprobs(p)
    out.lora = short_str(LORA, p.get(LORA)) or None
    out.structured = {k: p[k] for k in (*STRUCTURED_PARAMS, LOGIT_BIAS) if k in p}
    tname = REQUEST_TIMEOUT if REQUEST_TIMEOUT in p else PLAIN_TIMEOUT
    if tname in p:
        out.timeout = _as_float(tname, p[tname])
        if not 0 < out.timeout <= MAX_TIMEOUT:
            raise ParamError(tname, f"{tname} must be in (0, {MAX_TIMEOUT:.0f}] seconds, got {out.timeout}")
    out.tenant = short_str(TENANT, p.get(TENANT)) or None
    pname = REQUEST_PRIORITY if REQUEST_PRIORITY in p else PLAIN_PRIORITY
    out.priority = _as_int(pname, p[pname]) if pname in p else 0
    if not PRIORITY_RANGE[0] <= out.priority <= PRIORITY_RANGE[1]:
        raise ParamError(pname, f"{pname} must be in [{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}]")
    out.embed = EMBED in p and _as_bool(EMBED, p[EMBED])
    if out.embed:
        out.dimensions = _as_int(DIMENSIONS, p[DIMENSIONS]) if DIMENSIONS in p else None
        out.normalize = _as_bool(NORMALIZE, p[NORMALIZE]) if NORMALIZE in p else None
    out.stream = _as_bool(STREAM, p[STREAM]) if STREAM in p else True
    out.cache_salt = short_str(CACHE_SALT, p.get(CACHE_SALT)) or None
    return out


def read(name: str, v: Any) -> Any:
    """One parameter's value by its type (a name of INT/FLOAT/BOOL/LIST_PARAMS)."""
    if name in INT_PARAMS:
        return _as_int(name, v)
    if name in FLOAT_PARAMS:
        return _as_float(name, v)
    if name in BOOL_PARAMS:
        return _as_bool(name, v)
    return _as_list(name, v)


def short_str(name: str, v: Any) -> str | None:
    if v is None:
        return None
    text = v if isinstance(v, str) else str(v)
    if len(text) > MAX_TENANT_CHARS:
        raise ParamError(name, f"{name} is longer than {MAX_TENANT_CHARS} characters")
    return text


def _as_int(name: str, v: Any) -> int:
    """An integer parameter; anything outside int64 is invalid (it would overflow downstream)."""
    out = None
    if isinstance(v, bool):
        raise ParamError(name, f"{name} must be an integer, got {v!r}")
    if isinstance(v, int):
        out = v
    elif isinstance(v, float) and math.isfinite(v) and v == int(v):
        out = int(v)
    elif isinstance(v, str) and len(v) <= 40:
        try:
            out = int(v.strip())
        except ValueError:
            pass
    if out is None:
        raise ParamError(name, f"{name} must be an integer, got {str(v)[:40]!r}")
    if not INT64_MIN <= out <= INT64_MAX:
        raise ParamError(name, f"{name} is out of range (a 64-bit integer is expected)")
    return out


def _as_float(name: str, v: Any) -> float:
    if isinstance(v, bool):
        raise ParamError(name, f"{name} must be a number, got {v!r}")
    if isinstance(v, (int, float)):
        f = float(v)
    else:
        try:
            f = float(str(v).strip())
        except ValueError:
            raise ParamError(name, f"{name} must be a number, got {v!r}") from None
    if not math.isfinite(f):
        raise ParamError(name, f"{name} must be a finite number, got {v!r}")
    return f


def _as_bool(name: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str):
        try:
            return parse_bool(v, name=name)     # the one boolean dialect (common/env.py)
        except ValueError:
            pass
    raise ParamError(name, f"{name} must be a boolean, got {v!r}")


def _as_list(name: str, v: Any) -> list[Any]:
    if isinstance(v, list):
        return v
    if isinstance(v, str):
        try:
            parsed = json.loads(v)
        except ValueError:
            parsed = None
        if isinstance(parsed, list):
            return parsed
        if name == STOP:                # a single stop string given as is
            return [v] if v else []
        if isinstance(parsed, int) and not isinstance(parsed, bool):
            return [parsed]
    if isinstance(v, int) and not isinstance(v, bool) and name == STOP_TOKEN_IDS:
        return [v]
    raise ParamError(name, f"{name} must be a JSON list, got {v!r}")


def _logprobs(p: dict[str, Any]) -> int | None:
    """OpenAI chat: ``logprobs`` bool + ``top_logprobs`` int; also accepted: ``logprobs`` = int."""
    v = p.get(LOGPROBS_PARAM)
    top = p.get(TOP_LOGPROBS)
    if v is None or v == "":
        return None if top is None else _as_int(TOP_LOGPROBS, top)
    if isinstance(v, bool) or (isinstance(v, str) and v.strip().lower() in ("true", "false")):
        if not _as_bool(LOGPROBS_PARAM, v):
            return None
        return 0 if top is None else _as_int(TOP_LOGPROBS, top)
    return _as_int(LOGPROBS_PARAM, v)
