"""Request parameters (tritonclient ``parameters=``) -> validated generation settings.

Triton hands a request's parameters to the Python backend as a JSON object whose values are strings,
integers, floats or booleans. Names are OpenAI's; lists (``stop``, ``stop_token_ids``) come as JSON
strings. Every step of the ``llm`` ensemble sees the same parameters, so preprocessing rejects a bad
value before the engine ever sees the request, and the engine (called directly) checks them again.
Unknown parameters are ignored, like unknown fields of an OpenAI request.

Triton's front ends consume parameters named ``priority`` and ``timeout`` themselves (they never
reach a model), so a request's priority and deadline travel as ``request_priority`` and
``request_timeout`` (the plain names are still accepted should they arrive).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from backend import protocol as P
from backend.errors import invalid_request
from backend.pooling_params import PoolingParams
from backend.sampling_params import InvalidSamplingParam, SamplingParams
from backend.structured.spec import parse_logit_bias, spec_from_params

MAX_TIMEOUT = 24 * 3600.0
# Triton's front ends consume "priority" / "timeout" themselves; accepted should they arrive anyway.
PLAIN_PRIORITY, PLAIN_TIMEOUT = "priority", "timeout"


@dataclass
class RequestSettings:
    sampling: SamplingParams
    stream: bool = True
    max_tokens_given: bool = False      # False: max_tokens is the default and may be shortened to fit
    tenant: str | None = None
    priority: int = 0
    timeout: float | None = None        # seconds from arrival
    cache_salt: str | None = None       # used only with the engine option allow_client_salt
    extra: dict = field(default_factory=dict)
    pooling: PoolingParams | None = None    # parameter embed=true: an embedding request


def parse_parameters(raw: str | dict | None) -> dict:
    """``request.parameters()`` (a JSON string) -> dict."""
    if raw is None or raw == "":
        return {}
    if isinstance(raw, dict):
        return dict(raw)
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise invalid_request("parameters", f"request parameters are not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise invalid_request("parameters", "request parameters must be a JSON object")
    return value


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
PRIORITY_RANGE = (-1_000_000, 1_000_000)


def _as_int(name: str, v) -> int:
    """An integer parameter; anything outside int64 is invalid (it would overflow downstream)."""
    out = None
    if isinstance(v, bool):
        raise invalid_request(name, f"{name} must be an integer, got {v!r}")
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
        raise invalid_request(name, f"{name} must be an integer, got {str(v)[:40]!r}")
    if not INT64_MIN <= out <= INT64_MAX:
        raise invalid_request(name, f"{name} is out of range (a 64-bit integer is expected)")
    return out


def _as_float(name: str, v) -> float:
    if isinstance(v, bool):
        raise invalid_request(name, f"{name} must be a number, got {v!r}")
    if isinstance(v, (int, float)):
        f = float(v)
    else:
        try:
            f = float(str(v).strip())
        except ValueError:
            raise invalid_request(name, f"{name} must be a number, got {v!r}") from None
    if not math.isfinite(f):
        raise invalid_request(name, f"{name} must be a finite number, got {v!r}")
    return f


def _as_bool(name: str, v) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in ("true", "1", "yes", "false", "0", "no"):
        return v.strip().lower() in ("true", "1", "yes")
    raise invalid_request(name, f"{name} must be a boolean, got {v!r}")


def _as_list(name: str, v) -> list:
    if isinstance(v, list):
        return v
    if isinstance(v, str):
        try:
            parsed = json.loads(v)
        except ValueError:
            parsed = None
        if isinstance(parsed, list):
            return parsed
        if name == P.STOP:              # a single stop string given as is
            return [v] if v else []
        if isinstance(parsed, int) and not isinstance(parsed, bool):
            return [parsed]
    if isinstance(v, int) and not isinstance(v, bool) and name == P.STOP_TOKEN_IDS:
        return [v]
    raise invalid_request(name, f"{name} must be a JSON list, got {v!r}")


def _logprobs(params: dict) -> int | None:
    """OpenAI chat: ``logprobs`` bool + ``top_logprobs`` int; also accepted: ``logprobs`` = int."""
    v = params.get(P.LOGPROBS_PARAM)
    top = params.get(P.TOP_LOGPROBS)
    if v is None or v == "":
        return None if top is None else _as_int(P.TOP_LOGPROBS, top)
    if isinstance(v, bool) or (isinstance(v, str) and v.strip().lower() in ("true", "false")):
        if not _as_bool(P.LOGPROBS_PARAM, v):
            return None
        return 0 if top is None else _as_int(P.TOP_LOGPROBS, top)
    return _as_int(P.LOGPROBS_PARAM, v)


def request_settings(params: dict) -> RequestSettings:
    """Validate parameters; raises an invalid_request EngineError naming the bad one."""
    p = {k: v for k, v in params.items() if v is not None}
    if P.MAX_TOKENS not in p and P.MAX_COMPLETION_TOKENS in p:
        p[P.MAX_TOKENS] = p[P.MAX_COMPLETION_TOKENS]
    kwargs: dict = {}
    for name in P.SAMPLING_PARAMS:
        if name not in p:
            continue
        v = p[name]
        if name in P.INT_PARAMS:
            kwargs[name] = _as_int(name, v)
        elif name in P.FLOAT_PARAMS:
            kwargs[name] = _as_float(name, v)
        elif name in P.BOOL_PARAMS:
            kwargs[name] = _as_bool(name, v)
        else:
            kwargs[name] = _as_list(name, v)
    kwargs["logprobs"] = _logprobs(p)
    kwargs["lora"] = _short_str(P.LORA, p.get(P.LORA)) or None     # resolved by the engine (backend/lora)
    try:                                    # structured outputs (backend/structured/spec.py)
        kwargs["structured"] = spec_from_params(p)
        kwargs["logit_bias"] = parse_logit_bias(p.get(P.LOGIT_BIAS))
    except InvalidSamplingParam as exc:
        raise invalid_request(exc.param, str(exc)) from None
    kwargs.setdefault(P.MAX_TOKENS, None)   # omitted: the rest of the context (OpenAI semantics)
    try:
        sampling = SamplingParams(**kwargs)
    except InvalidSamplingParam as exc:
        raise invalid_request(exc.param, str(exc)) from None
    timeout = None
    tname = P.REQUEST_TIMEOUT if P.REQUEST_TIMEOUT in p else PLAIN_TIMEOUT
    if tname in p:
        timeout = _as_float(tname, p[tname])
        if not 0 < timeout <= MAX_TIMEOUT:
            raise invalid_request(tname, f"{tname} must be in (0, {MAX_TIMEOUT:.0f}] seconds, got {timeout}")
    pname = P.REQUEST_PRIORITY if P.REQUEST_PRIORITY in p else PLAIN_PRIORITY
    tenant = _short_str(P.TENANT, p.get(P.TENANT))
    priority = _as_int(pname, p[pname]) if pname in p else 0
    if not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
        raise invalid_request(pname, f"{pname} must be in [{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}]")
    for t in sampling.stop_token_ids or ():
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= INT64_MAX:
            raise invalid_request(P.STOP_TOKEN_IDS, "stop_token_ids must be non-negative integers")
    return RequestSettings(
        pooling=_pooling(p),
        sampling=sampling,
        stream=_as_bool(P.STREAM, p[P.STREAM]) if P.STREAM in p else True,
        max_tokens_given=P.MAX_TOKENS in p,
        tenant=tenant or None,
        priority=priority,
        timeout=timeout,
        cache_salt=_short_str(P.CACHE_SALT, p.get(P.CACHE_SALT)) or None,
    )


def _pooling(p: dict) -> PoolingParams | None:
    """``embed``, ``dimensions``, ``normalize`` -> PoolingParams (None: not an embedding request)."""
    if P.EMBED not in p or not _as_bool(P.EMBED, p[P.EMBED]):
        return None
    pooling = PoolingParams(dimensions=_as_int(P.DIMENSIONS, p[P.DIMENSIONS]) if P.DIMENSIONS in p else None,
                            normalize=_as_bool(P.NORMALIZE, p[P.NORMALIZE]) if P.NORMALIZE in p else None)
    try:
        pooling.validate()
    except InvalidSamplingParam as exc:
        raise invalid_request(exc.param, str(exc)) from None
    return pooling


def _short_str(name: str, v) -> str | None:
    if v is None:
        return None
    v = v if isinstance(v, str) else str(v)
    if len(v) > P.MAX_TENANT_CHARS:
        raise invalid_request(name, f"{name} is longer than {P.MAX_TENANT_CHARS} characters")
    return v


def cache_salt(settings: "RequestSettings", allow_client_salt: bool) -> str | None:
    """The prefix-cache salt: the tenant's, namespaced so no client-chosen ``cache_salt`` can
    equal it; a client's own ``cache_salt`` only when the server allows it (docs/serving.md)."""
    if allow_client_salt and settings.cache_salt:
        return f"client:{settings.cache_salt}"
    return f"tenant:{settings.tenant}" if settings.tenant else None


def fit_context(settings: RequestSettings, prompt_len: int, context_window: int, param: str) -> None:
    """Reject prompts that leave no room to generate; shorten a default max_tokens to fit.

    An explicit max_tokens that does not fit is an error (as in the OpenAI API) rather than a
    silently shorter answer.
    """
    if prompt_len < 1:
        raise invalid_request(param, "the prompt is empty")
    if settings.pooling is not None:        # an embedding: the whole window, nothing generated
        if prompt_len > context_window:
            raise invalid_request(param, f"the input has {prompt_len} tokens but the context window is "
                                         f"{context_window} tokens")
        return
    if prompt_len >= context_window:
        raise invalid_request(param, f"the prompt has {prompt_len} tokens but the context window is "
                                     f"{context_window} tokens (at least one must be left to generate)")
    room = context_window - prompt_len
    sp = settings.sampling
    if sp.max_tokens is None:
        sp.max_tokens = room
    elif sp.max_tokens > room:
        if settings.max_tokens_given:
            raise invalid_request(P.MAX_TOKENS, f"max_tokens {sp.max_tokens} plus the prompt's {prompt_len} "
                                                f"tokens exceed the context window of {context_window} tokens")
        sp.max_tokens = room
    if sp.min_tokens > sp.max_tokens:
        raise invalid_request(P.MIN_TOKENS, f"min_tokens {sp.min_tokens} exceeds max_tokens {sp.max_tokens}")
