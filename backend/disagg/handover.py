"""The hand-over record: everything the decode engine needs to continue a request, except the
KV bytes themselves (those go through a KV connector; ``locator`` says where to fetch them).

Control plane and data plane are separate on purpose (as in Dynamo / vLLM's KV connectors): the
record is small JSON that any router can carry; the blocks move point to point. The record is
plain data (no pickle), so a decode engine can take it from another process or host. It is
*not* trusted: it travels through the router and a caller of the decode server's Triton port can
forge one. ``from_json`` + ``validate`` check every field's type and range on the intake thread
(a bad record is that request's 400, never the engine thread's exception); ``check`` says whether
the KV fits this pool (else the decode side recomputes). Who the request belongs to (its salt,
its priority) is never in the record: the decode side takes them from its own request.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from backend.outputs import TokenLogprob
from backend.engine.admission import SamplingParams

VERSION = 2
MAX_RECORD_CHARS = 8 << 20           # a 32k-token prompt is ~200 KB of JSON
GENERATOR_STATE_BYTES = torch.Generator().get_state().numel()


@dataclass
class Handover:
    request_id: str
    prompt_token_ids: list[int]
    first_token: int                    # sampled by the prefill engine; no KV yet
    params: dict                        # SamplingParams fields (structured / logit_bias: never handed over)
    max_tokens: int                     # resolved on the prefill side
    num_kv_tokens: int                  # prompt tokens whose KV is staged (== len(prompt_token_ids))
    block_size: int
    block_shape: list[int]              # [layers, 2, block_size, kv_heads, head_dim]: must match the decode pool
    dtype: str                          # "float32" ...
    locator: dict | None                # connector-specific; None = nothing staged (decode recomputes)
    stream: bool = True
    deadline_in: float | None = None    # seconds left at hand-over (monotonic clocks differ across hosts)
    queue_time: float = 0.0             # prefill-side queueing, reported in the deltas
    num_cached_tokens: int = 0          # prefill-side prefix hit, reported in the deltas
    first_logprob: list | None = None   # [token_id, logprob, [[id, lp], ...]] when logprobs were asked
    generator_state: str | None = None  # seeded sampling: the choice's torch.Generator after token 1
    version: int = VERSION
    extra: dict = field(default_factory=dict)

    # -- building / reading ---------------------------------------------------------------
    def sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.params)

    def logprob(self) -> TokenLogprob | None:
        if self.first_logprob is None:
            return None
        tid, lp, top = self.first_logprob
        return TokenLogprob(int(tid), float(lp), [(int(i), float(v)) for i, v in top])

    def generator(self) -> torch.Generator | None:
        if self.generator_state is None:
            return None
        if not isinstance(self.generator_state, str) or len(self.generator_state) > 4 * GENERATOR_STATE_BYTES:
            raise ValueError("generator_state must be a base64 string")
        try:
            raw = base64.b64decode(self.generator_state, validate=True)
        except binascii.Error:
            raise ValueError("generator_state is not base64") from None
        if len(raw) != GENERATOR_STATE_BYTES:
            raise ValueError(f"generator_state has {len(raw)} bytes, expected {GENERATOR_STATE_BYTES}")
        g = torch.Generator()
        try:
            g.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        except RuntimeError as exc:
            raise ValueError(f"generator_state: {exc}") from None
        return g

    @property
    def num_blocks(self) -> int:
        return -(-self.num_kv_tokens // self.block_size)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Handover":
        if len(text) > MAX_RECORD_CHARS:
            raise ValueError(f"hand-over record of {len(text)} characters exceeds {MAX_RECORD_CHARS}")
        try:
            d = json.loads(text)
        except RecursionError:
            raise ValueError("hand-over record nested too deeply") from None
        if not isinstance(d, dict):
            raise ValueError("hand-over record is not a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"hand-over record has unknown fields {sorted(unknown)}")
        return cls(**d)

    def validate(self, *, vocab_size: int, max_model_len: int) -> None:
        """Every field's type and range (ValueError naming the field): after this, nothing the
        decode engine thread does with the record can raise on a value."""
        if self.version != VERSION:
            raise ValueError(f"record version {self.version!r}, expected {VERSION}")
        _check_tokens("prompt_token_ids", self.prompt_token_ids, vocab_size, max_model_len)
        _int("first_token", self.first_token, 0, vocab_size - 1)
        _int("max_tokens", self.max_tokens, 1, max_model_len)
        _int("num_kv_tokens", self.num_kv_tokens, len(self.prompt_token_ids), len(self.prompt_token_ids))
        _int("num_cached_tokens", self.num_cached_tokens, 0, len(self.prompt_token_ids))
        _int("block_size", self.block_size, 1, 1 << 16)
        if not isinstance(self.block_shape, list) or len(self.block_shape) != 5:
            raise ValueError("block_shape must be 5 integers")
        for d in self.block_shape:
            _int("block_shape", d, 1, 1 << 20)
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"dtype {self.dtype!r} is not a KV dtype")
        if not isinstance(self.stream, bool):
            raise ValueError("stream must be a boolean")
        _float("queue_time", self.queue_time, 0.0, 1e7)
        if self.deadline_in is not None:
            _float("deadline_in", self.deadline_in, -1e7, 1e7)
        if not isinstance(self.params, dict) or self.params.get("structured") or self.params.get("logit_bias"):
            raise ValueError("params must be an object without structured / logit_bias")
        if SamplingParams(**self.params).n != 1:       # its own range checks (ValueError / TypeError)
            raise ValueError("params.n must be 1: n > 1 is never handed over")
        self._validate_locator()
        self._validate_logprob(vocab_size)
        if self.generator_state is not None:
            self.generator()                           # decodes and loads it: a bad one raises here
        if not isinstance(self.extra, dict) or len(self.extra) > 8:
            raise ValueError("extra must be a small object")
        staged_at = self.extra.get("staged_at", 0.0)
        if staged_at is not None:
            _float("extra.staged_at", staged_at, 0.0, 1e11)

    def _validate_locator(self) -> None:
        loc = self.locator
        if loc is None:
            return
        if not isinstance(loc, dict) or len(loc) > 16 or len(json.dumps(loc)) > 4096:
            raise ValueError("locator must be a small object")
        shape = loc.get("shape")
        if shape != [self.num_blocks, *self.block_shape] or loc.get("dtype") != self.dtype:
            raise ValueError("locator shape / dtype differ from the record's blocks")

    def _validate_logprob(self, vocab_size: int) -> None:
        lp = self.first_logprob
        if lp is None:
            return
        if not (isinstance(lp, list) and len(lp) == 3 and isinstance(lp[2], list) and len(lp[2]) <= 64):
            raise ValueError("first_logprob must be [token, logprob, [[token, logprob], ...]]")
        pairs = [lp[:2], *lp[2]]
        if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
            raise ValueError("first_logprob's top entries must be [token, logprob] pairs")
        for tid, value in pairs:
            _int("first_logprob", tid, 0, vocab_size - 1)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value) or value > 0:
                raise ValueError("first_logprob values must be log-probabilities")

    def check(self, *, vocab_size: int, block_size: int, block_shape: tuple[int, ...], dtype: torch.dtype) -> str | None:
        """Why this record's KV cannot be used by a pool of this shape (None = it can)."""
        if self.version != VERSION:
            return f"record version {self.version}, expected {VERSION}"
        if self.num_kv_tokens != len(self.prompt_token_ids):
            return "num_kv_tokens differs from the prompt length"
        if not 0 <= self.first_token < vocab_size:
            return "first token out of the vocabulary"
        if self.block_size != block_size or tuple(self.block_shape) != tuple(block_shape):
            return f"block shape {self.block_shape} (block_size {self.block_size}) differs from the pool's {list(block_shape)}"
        if self.dtype != dtype_name(dtype):
            return f"KV dtype {self.dtype} differs from the pool's {dtype_name(dtype)}"
        return None


def _int(name: str, v, lo: int, hi: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}"[:200])


def _float(name: str, v, lo: float, hi: float) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or not lo <= v <= hi:
        raise ValueError(f"{name} must be a finite number in [{lo}, {hi}], got {v!r}"[:200])


def _check_tokens(name: str, ids, vocab_size: int, max_len: int) -> None:
    if not isinstance(ids, list) or not 1 <= len(ids) <= max_len:
        raise ValueError(f"{name} must be a list of 1 to {max_len} token ids")
    for t in ids:
        if type(t) is not int or not 0 <= t < vocab_size:
            raise ValueError(f"{name} holds {t!r}, not a token id below {vocab_size}"[:200])


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    d = dataclasses.asdict(params)
    d.pop("structured", None)
    d.pop("logit_bias", None)
    return d


def generator_state(g: torch.Generator | None) -> str | None:
    return None if g is None else base64.b64encode(bytes(g.get_state().tolist())).decode("ascii")
