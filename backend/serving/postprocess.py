"""What an engine response carries: token windows -> text deltas (the plain-Python half of the
stateless ``postprocessing`` model, and the engine's response thread), and a ``StepDelta`` -> the
engine model's output tensors.

Each engine response carries a short window of token ids and how many of them were already sent
(backend/outputs.py decode_delta), so any postprocessing instance can turn any response into its exact text
delta without per-request state. The engine's response thread calls the same ``Postprocessor`` on each
delta (``delta_text``), so the ``llm`` ensemble needs no postprocessing step per token and the text is
the same byte for byte. Logprobs are converted from the engine's ids to OpenAI's chat
shape: ``[{"token", "bytes", "logprob", "top_logprobs": [{"token", "bytes", "logprob"}]}]``.

The engine's output tensors (numpy): names, dtypes and dims are backend/protocol.py's
ENGINE_OUTPUTS, in that order; only the names the caller requested are built (the ``llm`` ensemble
asks for nine of the thirteen, so a streamed token costs nine small arrays)::

    logprobs       JSON [{"id","logprob","top":[[id,logprob],...]}] or ""
    metrics        JSON {"queue_time","ttft","num_preemptions"} on the final response, else ""
    text_output    the text delta (``Postprocessor.delta_text``, computed by the response thread)
    text_logprobs  logprobs in OpenAI's chat shape or ""
    embedding      an embedding request's vector, FP32 (empty for generations)
"""
from __future__ import annotations

import json
import pathlib
from typing import Collection

import numpy as np

from backend import protocol as P
from backend.outputs import decode_delta
from backend.outputs import StepDelta
from backend.serving.preprocess import load_tokenizer


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode (byte-level BPE token strings -> raw bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenBytes:
    """The raw bytes of one token (a token may hold part of a multi-byte character)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = (tokenizer.backend_tokenizer.decoder.__class__.__name__
                   if getattr(tokenizer, "backend_tokenizer", None) is not None else "")
        self.byte_level = decoder == "ByteLevel"
        self._bd = _byte_decoder() if self.byte_level else None
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        b = self._cache.get(token_id)
        if b is None:
            b = self._cache[token_id] = self._bytes(token_id)
        return b

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
        if piece is None:
            return b""
        if piece in self.tokenizer.all_special_tokens:
            return piece.encode("utf-8")
        if self.byte_level and all(ch in self._bd for ch in piece):
            return bytes(self._bd[ch] for ch in piece)
        if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:   # sentencepiece byte fallback
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")


class RustDecode:
    """``tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`` of a
    transformers fast tokenizer, straight on its Rust ``tokenizers.Tokenizer``: for a list of ids
    and no clean-up transformers itself does exactly this call, after ~20 us of Python around it
    (a streamed token decodes twice or more)."""

    def __init__(self, backend) -> None:
        self._decode = backend.decode

    def decode(self, ids: list[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool = False) -> str:
        assert not clean_up_tokenization_spaces
        return self._decode(ids, skip_special_tokens=skip_special_tokens)


def fast_decoder(tokenizer):
    """RustDecode for a transformers fast tokenizer whose decode path is the stock one, else the
    tokenizer itself."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return tokenizer
    cls = type(tokenizer)
    if (isinstance(tokenizer, TokenizersBackend) and cls._decode is TokenizersBackend._decode
            and cls.decode is PreTrainedTokenizerBase.decode and getattr(tokenizer, "_tokenizer", None) is not None):
        return RustDecode(tokenizer._tokenizer)
    return tokenizer


class Postprocessor:
    def __init__(self, model_dir: str | pathlib.Path) -> None:
        self.tokenizer = load_tokenizer(model_dir)
        self.token_bytes = TokenBytes(self.tokenizer)
        self.decoder = fast_decoder(self.tokenizer)

    def text(self, window_ids: list[int], num_sent: int, max_chars: int, finish_reason: str,
             skip_special_tokens: bool = True) -> str:
        return decode_delta(self.decoder, window_ids, num_sent, final=bool(finish_reason),
                            max_chars=max_chars, skip_special_tokens=skip_special_tokens)

    def _entry(self, token_id: int, logprob: float) -> dict:
        raw = self.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "bytes": list(raw), "logprob": logprob}

    def delta_text(self, delta, skip_special_tokens: bool = True) -> tuple[str, str]:
        """(text delta, OpenAI logprobs JSON) of an engine ``StepDelta``: what postprocessing makes
        of its response (same functions, same arguments)."""
        finish = (delta.finish_reason or "") if delta.finished else ""
        text = self.text(delta.window_ids, delta.num_sent, delta.max_chars, finish,
                         skip_special_tokens=skip_special_tokens)
        if not delta.logprobs:
            return text, ""
        out = []
        for lp in delta.logprobs:
            entry = self._entry(lp.token_id, float(lp.logprob))
            entry["top_logprobs"] = [self._entry(int(t), float(v)) for t, v in lp.top]
            out.append(entry)
        return text, json.dumps(out, ensure_ascii=False)

    def logprobs(self, engine_json: str) -> str:
        """Engine logprobs JSON -> OpenAI chat ``logprobs.content`` JSON ("" stays "")."""
        if not engine_json:
            return ""
        out = []
        for item in json.loads(engine_json):
            entry = self._entry(item["id"], item["logprob"])
            entry["top_logprobs"] = [self._entry(t, lp) for t, lp in item.get("top", [])]
            out.append(entry)
        return json.dumps(out, ensure_ascii=False)


_INT32 = np.int32
_EMPTY = np.array([b""], dtype=np.object_)      # never written to by the stubs (they copy inputs)
_NO_VECTOR = np.zeros((0,), dtype=np.float32)
TEXT_NAMES = frozenset((P.TEXT_OUTPUT, P.TEXT_LOGPROBS))


def string_array(text: str) -> np.ndarray:
    return np.array([text.encode("utf-8")], dtype=np.object_)


def _int1(v: int) -> np.ndarray:
    return np.array((v,), dtype=_INT32)


def _str1(text: str) -> np.ndarray:
    return string_array(text) if text else _EMPTY


def logprobs_json(delta: StepDelta) -> str:
    if not delta.logprobs:
        return ""
    return json.dumps([{"id": lp.token_id, "logprob": float(lp.logprob),
                        "top": [[int(t), float(v)] for t, v in lp.top]} for lp in delta.logprobs])


def finish_reason_of(delta: StepDelta) -> str:
    """The wire finish_reason: "" until the choice finished."""
    return (delta.finish_reason or "") if delta.finished else ""


def wants_text(want: Collection[str] | None) -> bool:
    """Whether a caller that requested ``want`` (None: everything) needs the detokenizer."""
    return want is None or not TEXT_NAMES.isdisjoint(want)


def metrics_json(delta: StepDelta, ttft: float | None) -> str:
    """The final response's metrics (plus the hand-over record of a prefill-role engine), else ""."""
    if not delta.finished:
        return ""
    m = {"queue_time": round(delta.queue_time, 6), "ttft": None if ttft is None else round(ttft, 6),
         "num_preemptions": delta.num_preemptions}
    record = getattr(delta, "handover", None)       # prefill role: backend/serving/disagg_engine.py
    if record is not None:
        m[P.HANDOVER] = record
    return json.dumps(m)


# output name -> builder(delta, ttft), in ENGINE_OUTPUTS order (the text outputs come from the caller)
_BUILDERS = (
    (P.OUTPUT_IDS, lambda d, t: np.array(d.new_token_ids, dtype=_INT32)),
    (P.WINDOW_IDS, lambda d, t: np.array(d.window_ids, dtype=_INT32)),
    (P.NUM_SENT, lambda d, t: _int1(d.num_sent)),
    (P.MAX_CHARS, lambda d, t: _int1(d.max_chars)),
    (P.FINISH_REASON, lambda d, t: _str1(finish_reason_of(d))),
    (P.INDEX, lambda d, t: _int1(d.index)),
    (P.PROMPT_TOKENS, lambda d, t: _int1(d.prompt_tokens)),
    (P.COMPLETION_TOKENS, lambda d, t: _int1(d.completion_tokens)),
    (P.CACHED_TOKENS, lambda d, t: _int1(d.cached_tokens)),
    (P.LOGPROBS, lambda d, t: _str1(logprobs_json(d))),
    (P.METRICS, lambda d, t: _str1(metrics_json(d, t))),
)


def engine_outputs(delta: StepDelta, *, ttft: float | None = None, text: tuple[str, str] | None = None,
                   want: Collection[str] | None = None) -> dict[str, np.ndarray]:
    """The response tensors of one delta. ``text`` = (text delta, OpenAI logprobs JSON) when the
    response thread detokenized it (else those two outputs are left out); ``want`` = the output
    names the caller requested (None: all)."""
    out = {name: build(delta, ttft) for name, build in _BUILDERS if want is None or name in want}
    if text is not None:
        for name, value in ((P.TEXT_OUTPUT, text[0]), (P.TEXT_LOGPROBS, text[1])):
            if want is None or name in want:
                out[name] = _str1(value)
    if want is None or P.EMBEDDING in want:
        out[P.EMBEDDING] = _NO_VECTOR if delta.embedding is None else np.asarray(delta.embedding, dtype=np.float32)
    return out


def control_outputs(stopped: bool) -> dict[str, np.ndarray]:
    """The answer to an abort control request: finish_reason "abort" if a request was stopped."""
    return {P.FINISH_REASON: string_array("abort" if stopped else ""), P.INDEX: _int1(0)}
