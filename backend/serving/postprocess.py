"""The plain-Python half of the stateless ``postprocessing`` model: token windows -> text deltas.

Each engine response carries a short window of token ids and how many of them were already sent
(backend/detokenizer.py), so any postprocessing instance can turn any response into its exact text
delta without per-request state. Logprobs are converted from the engine's ids to OpenAI's chat
shape: ``[{"token", "bytes", "logprob", "top_logprobs": [{"token", "bytes", "logprob"}]}]``.
"""
from __future__ import annotations

import json
import pathlib

from backend import protocol as P
from backend.detokenizer import decode_delta
from backend.serving.preprocess import load_tokenizer


def skip_special_tokens(params: dict) -> bool:
    """The request's skip_special_tokens (default True); preprocessing already rejected a bad value."""
    value = params.get(P.SKIP_SPECIAL_TOKENS, True)
    return value if isinstance(value, bool) else str(value).strip().lower() not in ("false", "0", "no")


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


class Postprocessor:
    def __init__(self, model_dir: str | pathlib.Path) -> None:
        self.tokenizer = load_tokenizer(model_dir)
        self.token_bytes = TokenBytes(self.tokenizer)

    def text(self, window_ids: list[int], num_sent: int, max_chars: int, finish_reason: str,
             skip_special_tokens: bool = True) -> str:
        return decode_delta(self.tokenizer, window_ids, num_sent, final=bool(finish_reason),
                            max_chars=max_chars, skip_special_tokens=skip_special_tokens)

    def _entry(self, token_id: int, logprob: float) -> dict:
        raw = self.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "bytes": list(raw), "logprob": logprob}

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
