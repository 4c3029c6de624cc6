"""The one error type that crosses layers: engine -> serving adapters -> Triton -> clients.

Everything that rejects or ends a request raises (or carries, in ``StepDelta.error``) an
:class:`EngineError` whose :class:`ErrorKind` says what happened. Nothing classifies errors by
message text: the kind is set where the error is made. The Triton boundary formats the kind as a
tag in exactly one place (``backend/serving/errors.py``) and the client parses it back in exactly
one place (``client/errors.py``); the wire format is documented in docs/architecture.md "Errors".

    kind             HTTP  wire tag
    invalid_request  400   [invalid_request param=<name>]
    queue_full       429   [queue_full retry_after=<s>]
    unavailable      503   [unavailable]
    deadline         503   [unavailable]   (the request's deadline passed; finish_reason "abort")
    internal         500   [internal]
"""
from __future__ import annotations

from enum import Enum


class InvalidSamplingParam(ValueError):
    """A setting out of range. ``param`` names it, so the engine tags the error without reading
    the message (a ValueError, so offline callers can catch it as one)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class ErrorKind(str, Enum):
    INVALID_REQUEST = "invalid_request"
    QUEUE_FULL = "queue_full"
    UNAVAILABLE = "unavailable"
    DEADLINE = "deadline"
    INTERNAL = "internal"


class EngineError(Exception):
    """A request the system rejects or ends; ``str()`` is the human-readable message only.

    ``param`` names the offending request field (invalid_request); ``retry_after`` is seconds
    (queue_full).
    """

    def __init__(self, kind: ErrorKind, message: str, *, param: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.kind = ErrorKind(kind)
        self.message = message
        self.param = param
        self.retry_after = retry_after

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in (("param", self.param), ("retry_after", self.retry_after))
                        if v is not None)
        return f"EngineError({self.kind.value}, {self.message!r}{extra})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, EngineError) and (self.kind, self.message, self.param, self.retry_after)
                == (other.kind, other.message, other.param, other.retry_after))

    __hash__ = Exception.__hash__


def invalid_request(param: str, message: str) -> EngineError:
    return EngineError(ErrorKind.INVALID_REQUEST, message, param=param)


def queue_full(message: str, retry_after: float = 1.0) -> EngineError:
    return EngineError(ErrorKind.QUEUE_FULL, message, retry_after=retry_after)


def unavailable(message: str) -> EngineError:
    return EngineError(ErrorKind.UNAVAILABLE, message)


def deadline_exceeded(message: str = "the request's deadline passed before it finished") -> EngineError:
    return EngineError(ErrorKind.DEADLINE, message)


def internal(message: str) -> EngineError:
    return EngineError(ErrorKind.INTERNAL, message)
