"""How a model turns its final hidden states into one embedding vector, read from its checkpoint.

    hidden states after the final norm  [num_tokens, hidden]
        ──► pool: "last" (the last token's row; vLLM's default for decoder LMs) | "mean" (all rows)
        ──► truncate to ``dimensions`` (Matryoshka models only) ──► L2-normalize (default on)

What the checkpoint may say (anything absent keeps the default):
  * ``modules.json`` + its Pooling module's ``config.json`` (sentence-transformers):
    ``pooling_mode_lasttoken`` → last, ``pooling_mode_mean_tokens`` → mean; other modes (cls, max)
    are not served and fall back to last with a warning. With a ``modules.json``, vectors are
    normalized only if it lists a ``Normalize`` module (as vLLM reads it); without one, always.
  * ``config.json``: ``matryoshka_dimensions`` (the sizes a request may ask for) or
    ``is_matryoshka: true`` (any size up to hidden). Without either, ``dimensions`` is refused.
"""
from __future__ import annotations

import json
import logging
import pathlib
from dataclasses import dataclass

import torch

log = logging.getLogger("triton_llm.model")
POOLING_TYPES = ("last", "mean")
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


@dataclass(frozen=True)
class PoolingConfig:
    pooling_type: str = "last"
    normalize: bool = True
    hidden_size: int = 0                         # 0: unknown (no dimensions check against it)
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()   # empty with is_matryoshka: any size up to hidden

    @classmethod
    def from_model_dir(cls, model_dir: str | pathlib.Path) -> "PoolingConfig":
        d = pathlib.Path(model_dir)
        cfg = _json(d / "config.json") or {}
        pooling, normalize = "last", True
        modules = _json(d / "modules.json")
        if isinstance(modules, list):
            normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules if isinstance(m, dict))
            for m in modules:
                if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling"):
                    st = _json(d / str(m.get("path", "")) / "config.json") or {}
                    modes = [mode for key, mode in _ST_MODES.items() if st.get(key)]
                    if modes:
                        pooling = modes[0]
                    elif any(v is True for k, v in st.items() if k.startswith("pooling_mode_")):
                        log.warning("%s: sentence-transformers pooling %s is not served; pooling the last "
                                    "token", d, [k for k, v in st.items() if v is True])
        dims = cfg.get("matryoshka_dimensions") or ()
        dims = tuple(int(x) for x in dims if isinstance(x, int) and not isinstance(x, bool) and x > 0)
        return cls(pooling_type=pooling, normalize=normalize, hidden_size=int(cfg.get("hidden_size") or 0),
                   is_matryoshka=bool(dims) or cfg.get("is_matryoshka") is True, matryoshka_dimensions=dims)


def _json(path: pathlib.Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def finish_vector(pooled: torch.Tensor, *, normalize: bool, dimensions: int | None) -> list[float]:
    """The pooled fp32 vector [hidden] -> the returned embedding: truncated, then normalized."""
    v = pooled.float()
    if dimensions is not None:
        v = v[:dimensions]
    if normalize:
        v = torch.nn.functional.normalize(v, p=2.0, dim=0)
    return v.tolist()
