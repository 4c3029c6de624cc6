"""Typed errors for clients of the ``llm`` ensemble and the ``engine`` model: the one tag parser.

Every server-side error message starts with a tag (docs/architecture.md "Errors"), formatted in
one place on the server (``backend/serving/errors.py`` ``to_wire``; a passed deadline goes out as
``[unavailable]``). Triton may put its own words in front ("in ensemble 'llm', ..."), so the tag
is searched, not anchored::

    [invalid_request param=<name>] <text>   -> InvalidRequestError   (HTTP 400)
    [queue_full retry_after=<s>] <text>     -> QueueFullError        (HTTP 429, Retry-After: s)
    [unavailable] <text>                    -> UnavailableError      (HTTP 503)
    [internal] <text> / anything untagged   -> InternalError         (HTTP 500)
"""
from __future__ import annotations

import re

_TAG = re.compile(r"\[(invalid_request|queue_full|unavailable|internal)((?:\s+\w+=[^\]\s]*)*)\s*\]\s*")


_NOT_LOADED = ("unknown model", "is not ready", "is not found", "not loaded")


class TritonLLMError(Exception):
    """Base class; ``status`` is the HTTP status an OpenAI-compatible front end answers with."""

    status = 500
    kind = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequestError(TritonLLMError):
    status = 400
    kind = "invalid_request"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class QueueFullError(TritonLLMError):
    status = 429
    kind = "queue_full"

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = max(1, int(retry_after))


class UnavailableError(TritonLLMError):
    status = 503
    kind = "unavailable"


class InternalError(TritonLLMError):
    status = 500
    kind = "internal"


class AbortedError(UnavailableError):
    """The server ended the request itself (``finish_reason="abort"``: drain, deadline, shutdown)."""


def error_from_message(message: str) -> TritonLLMError:
    """Map a (possibly prefixed) tagged server message to its typed error."""
    m = _TAG.search(message or "")
    if m is None:
        low = (message or "").lower()
        if any(s in low for s in _NOT_LOADED):   # Triton up, model not (yet) loaded
            return UnavailableError(message)
        return InternalError(message or "unknown server error")
    kind = m.group(1)
    attrs = dict(a.split("=", 1) for a in m.group(2).split())
    text = message[m.end():].strip() or kind.replace("_", " ")
    if kind == "invalid_request":
        return InvalidRequestError(text, param=attrs.get("param") or None)
    if kind == "queue_full":
        try:
            retry = int(round(float(attrs.get("retry_after", "1"))))
        except ValueError:
            retry = 1
        return QueueFullError(text, retry_after=retry)
    if kind == "unavailable":
        return UnavailableError(text)
    return InternalError(text)


def error_from_grpc(exc: BaseException) -> TritonLLMError:
    """A gRPC failure (server down, connection lost, stream error) -> typed error."""
    import grpc

    code = exc.code() if isinstance(exc, grpc.RpcError) and hasattr(exc, "code") else None
    details = exc.details() if isinstance(exc, grpc.RpcError) and hasattr(exc, "details") else None
    text = details or str(exc)
    mapped = error_from_message(text)
    if not isinstance(mapped, InternalError) or "[internal]" in text:
        return mapped
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.CANCELLED):
        return UnavailableError(f"Triton is not reachable: {text}")
    status = getattr(exc, "status", None)          # tritonclient's InferenceServerException
    if callable(status) and status() in ("StatusCode.UNAVAILABLE", "UNAVAILABLE"):
        return UnavailableError(f"Triton is not reachable: {text}")
    return InternalError(text)
