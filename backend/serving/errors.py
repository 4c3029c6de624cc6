"""Tagged error messages (docs/architecture.md "Errors") shared by every Triton model.

A message starts with a machine-readable tag so the shim and tritonclient users map it the same way:
``[invalid_request param=<name>]`` (400), ``[queue_full retry_after=<s>]`` (429), ``[unavailable]``
(503), ``[internal]`` (500).
"""
from __future__ import annotations

import re


class RequestError(Exception):
    """A request the server rejects; ``str()`` is the tagged message sent to the client."""

    def __init__(self, message: str, kind: str = "invalid_request") -> None:
        super().__init__(message)
        self.kind = kind


def invalid_request(param: str, text: str) -> RequestError:
    return RequestError(f"[invalid_request param={param}] {text}")


def unavailable(text: str) -> RequestError:
    return RequestError(f"[unavailable] {text}", kind="unavailable")


def queue_full(retry_after: float, text: str) -> RequestError:
    return RequestError(f"[queue_full retry_after={max(1, round(retry_after))}] {text}", kind="queue_full")


def _param_of(message: str) -> str:
    """SamplingParams / engine ValueErrors start with the offending parameter's name."""
    m = re.match(r"\s*([A-Za-z_][A-Za-z0-9_]*)\b", message)
    return m.group(1) if m else "request"


def tagged(exc: BaseException) -> RequestError:
    """Map any exception from request handling to a tagged RequestError."""
    if isinstance(exc, RequestError):
        return exc
    text = str(exc)
    m = re.match(r"\[(\w+)", text)
    if m:                                   # already tagged (engine QueueFullError, EngineLoop)
        return RequestError(text, kind=m.group(1))
    if type(exc).__name__ == "QueueFullError":
        return queue_full(float(getattr(exc, "retry_after", 1) or 1), text)
    if isinstance(exc, ValueError):
        return invalid_request(getattr(exc, "param", None) or _param_of(text), text)
    return RequestError(f"[internal] {type(exc).__name__}: {exc}", kind="internal")
