"""The hand-over record: everything the decode engine needs to continue a request, except the
KV bytes themselves (those go through a KV connector; ``locator`` says where to fetch them).

Control plane and data plane are separate on purpose (as in Dynamo / vLLM's KV connectors): the
record is small JSON that any router can carry; the blocks move point to point. The record is
plain data (no pickle), so a decode engine can take it from another process or host; it is
still *trusted* input (it comes from our own prefill engine), but ``check`` validates what a
bug or a mismatched deployment could get wrong before any KV is written.
"""
from __future__ import annotations

import base64
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from backend.outputs import TokenLogprob
from backend.sampling_params import SamplingParams

VERSION = 1


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
    salt: str | None = None
    priority: int = 0
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
        g = torch.Generator()
        g.set_state(torch.frombuffer(bytearray(base64.b64decode(self.generator_state)), dtype=torch.uint8))
        return g

    @property
    def num_blocks(self) -> int:
        return -(-self.num_kv_tokens // self.block_size)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Handover":
        d = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"hand-over record has unknown fields {sorted(unknown)}")
        return cls(**d)

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
