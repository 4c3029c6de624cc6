"""A request's parameters, read once by the engine's intake: the codec's ``RequestParams``
(common/param_codec.py: types, int64, priority, timeout) -> ``SamplingParams`` (value ranges),
``PoolingParams`` and the serving settings (stream, tenant, priority, deadline, salt).

Preprocessing does not read them (it takes only the prompt's own: ``tools``, ``embed``). The
structured-output fields are parsed only when a request gives one (``RequestParams.structured``);
any other request never enters backend/structured.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backend import protocol as P
from backend.errors import invalid_request
from backend.pooling_params import PoolingParams
from backend.sampling_params import InvalidSamplingParam, SamplingParams
from backend.structured.spec import parse_logit_bias, spec_from_params
from common import param_codec as codec


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
    try:
        return codec.parse_raw(raw)
    except codec.ParamError as exc:
        raise invalid_request(exc.param, str(exc)) from None


def read(params: dict, name: str, default: Any = None) -> Any:
    """One parameter by its type, ``default`` when absent (preprocessing's ``embed``,
    postprocessing's ``skip_special_tokens``); EngineError if bad."""
    if params.get(name) is None:
        return default
    try:
        return codec.read(name, params[name])
    except codec.ParamError as exc:
        raise invalid_request(exc.param, str(exc)) from None


def request_settings(params: dict) -> RequestSettings:
    """Validate parameters; raises an invalid_request EngineError naming the bad one."""
    try:
        rp = codec.decode(params)
        return RequestSettings(
            sampling=_sampling(rp), pooling=_pooling(rp), stream=rp.stream, max_tokens_given=rp.max_tokens_given,
            tenant=rp.tenant, priority=rp.priority, timeout=rp.timeout, cache_salt=rp.cache_salt)
    except (codec.ParamError, InvalidSamplingParam) as exc:
        raise invalid_request(exc.param, str(exc)) from None


def _sampling(rp: codec.RequestParams) -> SamplingParams:
    kwargs: dict[str, Any] = {P.MAX_TOKENS: None, **rp.sampling}   # omitted max_tokens: the rest of the context
    if rp.structured:                       # only a request that asks for one (backend/structured)
        kwargs["structured"] = spec_from_params(rp.structured)
        kwargs["logit_bias"] = parse_logit_bias(rp.structured.get(P.LOGIT_BIAS))
    return SamplingParams(**kwargs, logprobs=rp.logprobs, lora=rp.lora)


def _pooling(rp: codec.RequestParams) -> PoolingParams | None:
    """``embed``, ``dimensions``, ``normalize`` -> PoolingParams (None: not an embedding request)."""
    if not rp.embed:
        return None
    pooling = PoolingParams(dimensions=rp.dimensions, normalize=rp.normalize)
    pooling.validate()
    return pooling


def cache_salt(settings: "RequestSettings", allow_client_salt: bool) -> str | None:
    """The prefix-cache salt: the tenant's, namespaced so no client-chosen ``cache_salt`` can
    equal it; a client's own ``cache_salt`` only when the server allows it (docs/serving.md)."""
    if allow_client_salt and settings.cache_salt:
        return f"client:{settings.cache_salt}"
    return f"tenant:{settings.tenant}" if settings.tenant else None


def fit_prompt(prompt_len: int, context_window: int, param: str, embedding: bool = False) -> int:
    """The room a prompt leaves to generate; rejects one that is empty or leaves none (an
    embedding may fill the whole window). Preprocessing checks its prompt with this too."""
    if prompt_len < 1:
        raise invalid_request(param, "the prompt is empty")
    if embedding:                           # the whole window, nothing generated
        if prompt_len > context_window:
            raise invalid_request(param, f"the input has {prompt_len} tokens but the context window is "
                                         f"{context_window} tokens")
        return 0
    if prompt_len >= context_window:
        raise invalid_request(param, f"the prompt has {prompt_len} tokens but the context window is "
                                     f"{context_window} tokens (at least one must be left to generate)")
    return context_window - prompt_len


def fit_context(settings: RequestSettings, prompt_len: int, context_window: int, param: str) -> None:
    """Reject prompts that leave no room to generate; shorten a default max_tokens to fit.

    An explicit max_tokens that does not fit is an error (as in the OpenAI API) rather than a
    silently shorter answer.
    """
    room = fit_prompt(prompt_len, context_window, param, settings.pooling is not None)
    if settings.pooling is not None:
        return
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
