"""The Triton boundary's side of the error contract: an EngineError -> the documented wire tag.

This is the one place a tag is formatted (the client parses it back in ``client/errors.py``)::

    kind             wire tag (start of the TritonError message)      TritonError code
    invalid_request  [invalid_request param=<name>] <text>           INVALID_ARG
    queue_full       [queue_full retry_after=<whole s, >= 1>] <text> UNAVAILABLE
    unavailable      [unavailable] <text>                            UNAVAILABLE
    deadline         [unavailable] <text>                            UNAVAILABLE
    internal         [internal] <text>                               INTERNAL

Errors are classified where they are made (``backend/errors.py``); this module only formats them.
An exception that is not an EngineError is a bug on our side and goes out as ``internal``.
"""
from __future__ import annotations

from backend.errors import EngineError, ErrorKind, internal

# kind -> the tag's kind on the wire (a passed deadline is "unavailable" to clients)
_WIRE_KIND = {ErrorKind.INVALID_REQUEST: "invalid_request", ErrorKind.QUEUE_FULL: "queue_full",
              ErrorKind.UNAVAILABLE: "unavailable", ErrorKind.DEADLINE: "unavailable",
              ErrorKind.INTERNAL: "internal"}
# wire kind -> the name of the pb_utils.TritonError code (HTTP/gRPC status Triton answers with)
_TRITON_CODE = {"invalid_request": "INVALID_ARG", "queue_full": "UNAVAILABLE", "unavailable": "UNAVAILABLE",
                "internal": "INTERNAL"}
WIRE_KINDS = tuple(_TRITON_CODE)


def as_engine_error(exc: BaseException) -> EngineError:
    """An EngineError unchanged; anything else (a bug) as ``internal`` naming the exception."""
    if isinstance(exc, EngineError):
        return exc
    return internal(f"{type(exc).__name__}: {exc}")


def wire_kind(err: EngineError) -> str:
    """The kind the client sees (one of ``WIRE_KINDS``; also the rejected-requests metric label)."""
    return _WIRE_KIND[err.kind]


def to_wire(err: EngineError) -> str:
    """The documented tagged message, e.g. ``[invalid_request param=top_p] top_p must be in (0, 1]``."""
    kind = wire_kind(err)
    if kind == "invalid_request":
        tag = f"[invalid_request param={err.param or 'request'}]"
    elif kind == "queue_full":
        # Retry-After is whole seconds; never 0, which would invite an immediate retry storm.
        tag = f"[queue_full retry_after={max(1, round(err.retry_after or 1))}]"
    else:
        tag = f"[{kind}]"
    return f"{tag} {err.message}"


def triton_code(err: EngineError) -> str:
    """The ``pb_utils.TritonError`` code name for ``err`` (adapters: ``getattr(TritonError, name)``)."""
    return _TRITON_CODE[wire_kind(err)]

