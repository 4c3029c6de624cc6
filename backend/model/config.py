"""ModelConfig: the shape of a Llama-family checkpoint, read from its config.json.

Accepts both config layouts found in the wild:

* transformers 4: ``rope_theta`` at top level, ``rope_scaling`` dict (``type`` or ``rope_type``),
  ``torch_dtype``;
* transformers 5: ``rope_parameters`` dict holding ``rope_theta``, ``rope_type`` and the scaling
  keys, ``dtype``.

EOS ids are the union of config.json's ``eos_token_id`` and generation_config.json's (each an int
or a list), generation_config's first, since that is what ``generate()`` stops on.
"""
from __future__ import annotations

import json
import logging
import pathlib
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class RopeConfig:
    """Rotary embedding parameters; the scaling fields matter only for their ``rope_type``."""
    theta: float = 10000.0
    rope_type: str = "default"                 # default | linear | llama3
    factor: float = 1.0                        # linear, llama3
    low_freq_factor: float = 1.0               # llama3
    high_freq_factor: float = 4.0              # llama3
    original_max_position_embeddings: int | None = None  # llama3


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False                     # q/k/v projections have a bias (Qwen2 always)
    o_bias: bool = False                       # o_proj has a bias (Llama attention_bias)
    mlp_bias: bool = False
    dtype: str = "float32"                     # the checkpoint's own dtype
    eos_token_ids: list[int] = field(default_factory=list)
    sliding_window: int | None = None          # Mistral: not implemented; see max_model_len()

    def default_max_model_len(self) -> int:
        """Longest context we can serve exactly: we attend to the full context, so a model trained
        with a sliding window is only exact up to that window."""
        if self.sliding_window and self.sliding_window < self.max_position_embeddings:
            return self.sliding_window
        return self.max_position_embeddings


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _read_rope(cfg: dict) -> RopeConfig:
    params = cfg.get("rope_parameters")
    if params is None:                         # transformers 4 layout
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    params = dict(params)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope = RopeConfig(theta=float(theta), rope_type=rope_type)
    if rope_type in ("linear", "llama3"):
        rope.factor = float(params["factor"])
    if rope_type == "llama3":
        rope.low_freq_factor = float(params["low_freq_factor"])
        rope.high_freq_factor = float(params["high_freq_factor"])
        rope.original_max_position_embeddings = int(
            params.get("original_max_position_embeddings") or cfg["max_position_embeddings"])
    return rope


def load_model_config(model_dir: str | pathlib.Path) -> ModelConfig:
    """Read ``config.json`` (+ ``generation_config.json`` if present); ValueError if unsupported."""
    model_dir = pathlib.Path(model_dir)
    path = model_dir / "config.json"
    if not path.exists():
        raise ValueError(f"{model_dir} has no config.json: not a Hugging Face checkpoint directory")
    cfg = json.loads(path.read_text())
    return parse_model_config(cfg, _read_generation_eos(model_dir))


def _read_generation_eos(model_dir: pathlib.Path) -> list[int]:
    gen = model_dir / "generation_config.json"
    if not gen.exists():
        return []
    return _as_id_list(json.loads(gen.read_text()).get("eos_token_id"))


def parse_model_config(cfg: dict, generation_eos: list[int] | None = None) -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}: only SwiGLU (silu) models are supported")
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = cfg.get("head_dim") or hidden // num_heads
    # Only Llama reads attention_bias / mlp_bias; Mistral has no biases; Qwen2 always has q/k/v bias.
    is_llama = model_type == "llama"
    attention_bias = is_llama and bool(cfg.get("attention_bias", False))

    eos: list[int] = []
    for i in list(generation_eos or []) + _as_id_list(cfg.get("eos_token_id")):
        if i not in eos:
            eos.append(i)

    sliding = cfg.get("sliding_window")
    if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
        sliding = None                         # Qwen2 only slides when use_sliding_window is set
    if sliding is not None:
        log.warning("%s: sliding_window=%s is not implemented (full attention); contexts are "
                    "capped at the window so outputs stay exact", model_type, sliding)

    return ModelConfig(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rope=_read_rope(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=attention_bias,
        mlp_bias=is_llama and bool(cfg.get("mlp_bias", False)),
        dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        eos_token_ids=eos,
        sliding_window=int(sliding) if sliding else None,
    )
