"""The one tag formatter (backend/serving/errors.py) and the one parser (client/errors.py) agree."""
from __future__ import annotations

import pytest

from backend.errors import (EngineError, ErrorKind, deadline_exceeded, internal, invalid_request, queue_full,
                            unavailable)
from backend.serving.errors import WIRE_KINDS, as_engine_error, to_wire, triton_code
from client.errors import (InternalError, InvalidRequestError, QueueFullError, UnavailableError,
                           error_from_message)


@pytest.mark.parametrize("err, wire, code, cls", [
    (invalid_request("top_p", "top_p must be in (0, 1]"), "[invalid_request param=top_p] top_p must be in (0, 1]",
     "INVALID_ARG", InvalidRequestError),
    (queue_full("9 waiting", retry_after=2.4), "[queue_full retry_after=2] 9 waiting", "UNAVAILABLE", QueueFullError),
    (queue_full("9 waiting", retry_after=0.2), "[queue_full retry_after=1] 9 waiting", "UNAVAILABLE", QueueFullError),
    (unavailable("engine is not healthy"), "[unavailable] engine is not healthy", "UNAVAILABLE", UnavailableError),
    (deadline_exceeded("the deadline passed"), "[unavailable] the deadline passed", "UNAVAILABLE", UnavailableError),
    (internal("engine step failed"), "[internal] engine step failed", "INTERNAL", InternalError),
])
def test_each_kind_formats_as_documented_and_parses_back(err, wire, code, cls):
    assert to_wire(err) == wire and triton_code(err) == code
    back = error_from_message(f"in ensemble 'llm', {wire}")     # Triton may prefix its own words
    assert type(back) is cls and back.message == err.message
    if err.kind is ErrorKind.INVALID_REQUEST:
        assert back.param == err.param
    if err.kind is ErrorKind.QUEUE_FULL:
        assert back.retry_after == int(wire.split("retry_after=")[1].split("]")[0])


def test_every_kind_has_a_wire_form():
    for kind in ErrorKind:
        assert to_wire(EngineError(kind, "x")).split("]")[0].split()[0][1:] in WIRE_KINDS


def test_only_engine_errors_keep_their_kind():
    err = queue_full("full", retry_after=3)
    assert as_engine_error(err) is err
    bug = as_engine_error(ValueError("top_p must be in (0, 1]"))     # not classified by its text
    assert bug.kind is ErrorKind.INTERNAL and to_wire(bug) == "[internal] ValueError: top_p must be in (0, 1]"
