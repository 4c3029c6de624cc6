"""``PoolingParams``: what an embedding request asks of the pooled vector (vLLM's name and fields).

The pooling itself (last token or mean, and whether vectors are L2-normalized by default) is the
model's, read from its checkpoint by backend/model/pooling.py; a request may only change
``normalize`` and ask for fewer ``dimensions`` where the model declares Matryoshka support.
"""
from __future__ import annotations

from dataclasses import dataclass

from backend.errors import InvalidSamplingParam


@dataclass
class PoolingParams:
    dimensions: int | None = None       # truncate to this many (Matryoshka models only), then renormalize
    normalize: bool | None = None       # None: the model's default (backend/model/pooling.py)

    def validate(self) -> None:
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise InvalidSamplingParam("dimensions", f"dimensions must be a positive integer, got {d!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidSamplingParam("normalize", f"normalize must be a boolean, got {self.normalize!r}")
