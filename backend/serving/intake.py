"""A request entering the engine model: what execute() copied out of it (``Incoming``), its
parameters read once (``request_settings``), its admission (:class:`Intake`), and the typed
messages the engine model's threads hand each other.

    execute() thread ── Intake: Opened / Rejected ──┐
    engine thread ───── DeltaArrived (the sink) ────┼──► response queue ──► response thread
    abort future ────── ControlAnswered ────────────┘        (STOP ends it)

Every message for one request goes through the one queue, so the response thread sees them in the
order they were put: ``Opened`` always before the request's first ``DeltaArrived``. ``STOP`` is the
one stop sentinel of the serving threads (the response thread and the metrics thread).

The parameters: the codec's ``RequestParams`` (common/param_codec.py: types, int64, priority,
timeout) -> ``SamplingParams`` (value ranges), ``PoolingParams`` and the serving settings (stream,
tenant, priority, deadline, salt). Preprocessing reads only the prompt's own (``tools``,
``embed``). The structured-output fields are parsed only when a request gives one
(``RequestParams.structured``); any other request never enters backend/structured.

:class:`Intake` runs on Triton's execute thread and never blocks on the engine or on a send: it
reads the parameters, registers the request (``Opened``) before handing it to the EngineLoop, and
turns any failure into one ``Rejected`` message. A request with parameter ``abort_request_id`` and
no ``input_ids`` is an explicit abort of that request, answered once the engine applied it. A
structured-output request whose grammar is not compiled yet waits for it off this thread
(backend/structured/compiler.py ``prepare_async``: a worker thread with a budget); it enters the
engine when the grammar is ready, from the worker's callback, or gets its 400.
"""
from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

from backend import protocol as P
from backend.engine.roles import takes_handover
from backend.errors import EngineError, InvalidSamplingParam, invalid_request, unavailable
from backend.outputs import STOP, Stop  # noqa: F401  (the one stop sentinel, shared with the engine loop)
from backend.outputs import StepDelta
from backend.pooling_params import PoolingParams
from backend.engine.admission import SamplingParams
from backend.serving.errors import as_engine_error
from backend.serving.preprocess import fit_prompt, parse_parameters
from backend.structured.spec import parse_logit_bias, spec_from_params
from common import env
from common import param_codec as codec

if TYPE_CHECKING:
    from backend.serving.cancel_watch import AbortTombstones
    from backend.serving.response_thread import ResponseThread

log = logging.getLogger(__name__)


class Responder(Protocol):
    """One request's response sender (model.py wraps pb_utils' ResponseSender)."""

    def send(self, outputs: dict | None = None, *, error: EngineError | None = None,
             final: bool = False) -> None: ...

    def is_cancelled(self) -> bool: ...


@dataclass
class Incoming:
    """A request as execute() copied it out of pb_utils."""
    request_id: str
    input_ids: list[int] | None
    parameters: str | dict | None
    responder: Responder
    timeout_s: float | None = None          # Triton's own request timeout, if the client set one
    oversize: int = 0                       # input_ids longer than the context window: its length
                                            # (model.py checks before converting to a list)
    requested_outputs: frozenset[str] | None = None     # output names the caller asked for (None: all)


@dataclass(eq=False)                        # identity: two requests may share an id (one is rejected)
class RequestHandle:
    """One admitted-or-rejected request as the response thread tracks it (response thread only,
    except the fields intake sets before posting ``Opened``)."""
    rid: str
    responder: Responder
    arrival: float
    remaining: int = 1                      # choices whose final delta has not arrived
    stream: bool = True
    cancelled: bool = False                 # the client went away: no more data, bare FINAL
    done: bool = False                      # FINAL sent
    last_check: float = 0.0                 # last is_cancelled() round trip
    first_token: float | None = None        # latency bookkeeping (metrics.py LatencyRecorder)
    last_token: dict[int, float] = field(default_factory=dict)
    queue_time_seen: bool = False
    want: frozenset[str] | None = None      # output names to build (None: all; postprocess.py)
    skip_special_tokens: bool = True        # for the text outputs (backend/serving/postprocess.py)
    cancel_every: float = 0.0               # is_cancelled() at most this often (response_thread.py)
    held: dict[int, "Held"] = field(default_factory=dict)   # choice -> its gathered, unsent delta
    pace: dict = field(default_factory=dict)  # choice -> its pace between deltas (hold_policy.Pace)
    lora: str | None = None                 # its LoRA adapter's name, for the per-adapter metrics


@dataclass(slots=True)
class Held:
    """A choice's mid-stream tokens the response thread gathers (merged deltas), sent by ``due``."""
    delta: StepDelta
    due: float


@dataclass(slots=True)
class Opened:
    """Register the request before the engine can produce a delta for it."""
    handle: RequestHandle


@dataclass(slots=True)
class Rejected:
    """Admission failed: one error response with FINAL."""
    handle: RequestHandle
    error: EngineError


@dataclass(slots=True)
class DeltaArrived:
    """One choice's progress in one engine step (what the EngineLoop sink posts)."""
    handle: RequestHandle
    delta: StepDelta


@dataclass(slots=True)
class ControlAnswered:
    """An explicit abort (``abort_request_id``) came back from the engine; ``freed`` resolves to
    the instant the target's blocks were freed, or None if it was not running."""
    target: str
    responder: Responder
    seen: float                             # when the abort request arrived
    freed: Future


Message = Opened | Rejected | DeltaArrived | ControlAnswered | Stop


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


class Intake:
    """``lora``: what handles the ``lora_admin`` control request and warms a request's adapter
    (backend/serving/lora_control.py, handed in so that it may import these messages)."""

    def __init__(self, loop: Any, responses: ResponseThread, tombstones: AbortTombstones, *,
                 max_model_len: int, lora: Any, clock: Callable[[], float] = time.monotonic,
                 allow_client_salt: bool = False, test_faults: bool = False) -> None:
        self.loop = loop
        self.lora = lora
        self.allow_client_salt = allow_client_salt
        # Fault injection for tests: needs the engine option *and* the environment variable.
        self.test_faults = test_faults and env.flag("TRITON_LLM_TEST_FAULTS")
        self.responses = responses
        self.tombstones = tombstones
        self.max_model_len = max_model_len
        self.accepting = True               # False from the start of shutdown
        self._clock = clock

    def submit(self, inc: Incoming) -> None:
        now = self._clock()
        h = RequestHandle(inc.request_id or uuid.uuid4().hex, inc.responder, arrival=now, last_check=now)
        try:
            self._admit(h, inc, now)
        except EngineError as err:
            self.responses.post(Rejected(h, err))
        except Exception as exc:            # noqa: BLE001 - a bug: still exactly one answer
            log.exception("admitting request %s failed", h.rid)
            self.responses.post(Rejected(h, as_engine_error(exc)))

    def _admit(self, h: RequestHandle, inc: Incoming, now: float) -> None:
        params = parse_parameters(inc.parameters)
        if params.get(P.LORA_ADMIN) not in (None, ""):     # load / unload an adapter (lora_control.py)
            self.lora.handle(self.loop, params[P.LORA_ADMIN], h, self.responses.post, now)
            return
        target = params.get(P.ABORT_REQUEST_ID)
        if target not in (None, ""):
            tenant = params.get(P.TENANT)
            self._control(str(target)[:P.MAX_TENANT_CHARS], inc.responder, now,
                          "" if tenant is None else str(tenant))
            return
        if self.test_faults and params.get(P.TEST_FAULT) == "crash_engine":
            self.loop.inject_crash()
        if inc.oversize:
            raise invalid_request("input_ids", f"input_ids has {inc.oversize} tokens; the context window "
                                               f"is {self.max_model_len}")
        if inc.input_ids is None:
            raise invalid_request("input_ids", "input_ids is required (or the abort_request_id parameter)")
        if not self.accepting:
            raise unavailable("the server is shutting down")
        settings = request_settings(params)
        if settings.sampling.lora is not None:     # an evicted adapter is read here, not in a step
            self.lora.warm(self.loop, settings.sampling.lora)
            h.lora = settings.sampling.lora
        fit_context(settings, len(inc.input_ids), self.max_model_len, "input_ids")
        extra = {}
        record = params.get(P.HANDOVER)         # a continuation (prefill/decode disaggregation)
        if record not in (None, ""):
            if not takes_handover(self.loop):
                raise invalid_request(P.HANDOVER, "this engine takes no hand-overs (it is not role=decode)")
            extra["handover"] = str(record)
        if settings.pooling is not None:        # an embedding request: one final, the vector
            extra["pooling"] = settings.pooling
        h.remaining, h.stream = (1 if settings.pooling is not None else settings.sampling.n), settings.stream
        h.want = inc.requested_outputs or None
        h.skip_special_tokens = settings.sampling.skip_special_tokens
        grammars = getattr(self.loop, "grammars", None)
        if grammars is not None and settings.sampling.structured is not None and not extra:
            compiled = grammars.prepare_async(settings.sampling)     # caps / bias errors raise here
            if not compiled.done():
                compiled.add_done_callback(lambda f: self._enter_compiled(h, inc, settings, extra, now, f))
                return
            compiled.result()
        self._enter(h, inc, settings, extra, now)

    def _enter_compiled(self, h: RequestHandle, inc: Incoming, settings: Any, extra: dict, now: float,
                        compiled: Any) -> None:
        """On the grammar worker (or its deadline thread): the request's grammar is ready or failed."""
        try:
            compiled.result()
            if not self.accepting:
                raise unavailable("the server is shutting down")
            self._enter(h, inc, settings, extra, now)
        except EngineError as err:
            self.responses.post(Rejected(h, err))
        except Exception as exc:            # noqa: BLE001 - a bug: still exactly one answer
            log.exception("admitting request %s failed", h.rid)
            self.responses.post(Rejected(h, as_engine_error(exc)))

    def _enter(self, h: RequestHandle, inc: Incoming, settings: Any, extra: dict, now: float) -> None:
        post = self.responses.post
        if self.tombstones.take(h.rid):     # its abort overtook it: answer abort without running
            post(Opened(h))
            for i in range(h.remaining):
                post(DeltaArrived(h, StepDelta(h.rid, i, [], [], 0, finished=True, finish_reason="abort",
                                               prompt_tokens=len(inc.input_ids))))
            return
        timeouts = [t for t in (settings.timeout, inc.timeout_s) if t]
        deadline = now + min(timeouts) if timeouts else None
        post(Opened(h))                     # before the engine can produce a delta for it
        self.loop.submit(h.rid, inc.input_ids, settings.sampling, sink=lambda d: post(DeltaArrived(h, d)),
                         stream=settings.stream, salt=cache_salt(settings, self.allow_client_salt),
                         priority=settings.priority, deadline=deadline, tenant=settings.tenant, **extra)

    def _control(self, target: str, responder: Any, now: float, tenant: str) -> None:
        """An abort stops only a request of the caller's own tenant (the ``tenant`` parameter)."""
        self.tombstones.leave(target)
        fut = self.loop.abort(target, tenant=tenant)
        fut.add_done_callback(lambda f: self.responses.post(ControlAnswered(target, responder, now, f)))
