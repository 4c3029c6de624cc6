"""The gRPC wire of the ``llm`` ensemble and the ``engine`` model, client side: request parameters
out (:func:`to_parameters`, written by common/param_codec.py, the codec the server reads them
with), responses in (:func:`parse_response` -> :class:`Chunk`). The tensor names are
backend/protocol.py's, which the server reads too.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import numpy as np

from backend import protocol as P
from client.errors import InvalidRequestError
from common import param_codec

log = logging.getLogger("triton_llm.client")

@dataclass
class Chunk:
    """One response of one choice. ``text`` is the delta (ensemble); token ids are the delta's."""
    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None           # None until the choice finishes
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[dict] | None = None         # ensemble: OpenAI chat shape; engine: {"id","logprob","top"}
    metrics: dict | None = None                # final response: queue_time, ttft, num_preemptions
    window_ids: list[int] | None = None        # engine only (backend/outputs.py decode_delta)
    num_sent: int | None = None
    max_chars: int | None = None
    embedding: list[float] | None = None       # engine, an embedding request's final response


def to_parameters(params: dict | None) -> dict:
    """Python values -> Triton request parameters (str/int/float/bool; lists and dicts as JSON).
    An integer outside int64 is an InvalidRequestError naming it."""
    try:
        return param_codec.encode(params)
    except param_codec.ParamError as exc:
        raise InvalidRequestError(str(exc), param=exc.param) from None


def _scalar(result, name: str, default=None):
    arr = result.as_numpy(name)
    if arr is None or arr.size == 0:
        return default
    v = arr.reshape(-1)[0]
    return v.decode("utf-8", errors="replace") if isinstance(v, bytes) else v.item()


def _ids(result, name: str) -> list[int] | None:
    arr = result.as_numpy(name)
    return None if arr is None else [int(x) for x in arr.reshape(-1)]


def _json(result, name: str):
    return _loads(name, _scalar(result, name, ""))


def _loads(name: str, text: str | None):
    """A JSON output's value; None if empty or not JSON (logged)."""
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        log.warning("output %s is not JSON: %.80r", name, text)
        return None


def _str0(buf) -> str:
    """The first element of a raw BYTES tensor ("" if it has none)."""
    if len(buf) < 4:
        return ""
    n = int.from_bytes(buf[0:4], "little")
    return bytes(buf[4:4 + n]).decode("utf-8", errors="replace")


def _raw_outputs(result) -> dict | None:
    """name -> raw bytes of a tritonclient gRPC InferResult whose outputs are all raw INT32/BYTES
    (read once from the protobuf: tritonclient's ``as_numpy`` scans every output per call, a dozen
    scans and numpy arrays per streamed token), else None."""
    get = getattr(result, "get_response", None)
    if get is None:
        return None
    response = get()
    contents, outs = response.raw_output_contents, response.outputs
    if len(contents) != len(outs):
        return None
    raw = {}
    for i, o in enumerate(outs):
        if o.datatype not in ("INT32", "BYTES"):
            return None
        raw[o.name] = contents[i]
    return raw


def _parse_raw(raw: dict) -> Chunk:
    """The values ``as_numpy`` would give for the INT32 and BYTES[1] tensors of backend/protocol.py."""
    def s(name):
        b = raw.get(name)
        return None if b is None else _str0(b)

    def i(name, default=0):
        b = raw.get(name)
        return default if b is None or len(b) < 4 else int.from_bytes(b[0:4], "little", signed=True)

    def ids(name):
        b = raw.get(name)
        return None if b is None else np.frombuffer(b, dtype="<i4").tolist()

    def js(name):
        return _loads(name, s(name))

    return Chunk(index=i(P.INDEX), text=s(P.TEXT_OUTPUT) or "", token_ids=ids(P.OUTPUT_IDS) or [],
                 finish_reason=s(P.FINISH_REASON) or None, prompt_tokens=i(P.PROMPT_TOKENS),
                 completion_tokens=i(P.COMPLETION_TOKENS), cached_tokens=i(P.CACHED_TOKENS),
                 logprobs=js(P.LOGPROBS), metrics=js(P.METRICS), window_ids=ids(P.WINDOW_IDS),
                 num_sent=i(P.NUM_SENT, None), max_chars=i(P.MAX_CHARS, None))


def parse_response(result) -> Chunk:
    """A tritonclient InferResult of the ensemble or the engine -> Chunk."""
    raw = _raw_outputs(result)
    if raw is not None:
        return _parse_raw(raw)
    finish = _scalar(result, P.FINISH_REASON, "") or None
    return Chunk(
        index=int(_scalar(result, P.INDEX, 0) or 0),
        text=_scalar(result, P.TEXT_OUTPUT, "") or "",
        token_ids=_ids(result, P.OUTPUT_IDS) or [],
        finish_reason=finish,
        prompt_tokens=int(_scalar(result, P.PROMPT_TOKENS, 0) or 0),
        completion_tokens=int(_scalar(result, P.COMPLETION_TOKENS, 0) or 0),
        cached_tokens=int(_scalar(result, P.CACHED_TOKENS, 0) or 0),
        logprobs=_json(result, P.LOGPROBS),
        metrics=_json(result, P.METRICS),
        window_ids=_ids(result, P.WINDOW_IDS),
        num_sent=_scalar(result, P.NUM_SENT),
        max_chars=_scalar(result, P.MAX_CHARS),
        embedding=_floats(result, P.EMBEDDING),
    )


def _floats(result, name: str) -> list[float] | None:
    arr = result.as_numpy(name)
    return None if arr is None else arr.reshape(-1).tolist()


# (model, input) -> tritonclient's datatype of that input, read from backend/protocol.py's specs
# once at import: a request calls nothing there.
INPUT_DTYPES: dict[tuple[str, str], str] = {
    (model, t.name): t.client_dtype for model, io in P.MODELS.items() for t in io.inputs}


def _input(model: str, name: str, array: np.ndarray):
    """``model``'s input ``name`` holding ``array``."""
    from tritonclient.grpc import InferInput

    inp = InferInput(name, list(array.shape), INPUT_DTYPES[model, name])
    inp.set_data_from_numpy(array)
    return inp
