"""A PEFT LoRA adapter directory, read and checked against the base model.

    DIR/adapter_config.json        r, lora_alpha, target_modules, use_rslora, ...
    DIR/adapter_model.safetensors  base_model.model.model.layers.{i}.{self_attn|mlp}.{mod}.lora_A.weight [r, in]
                                   ...                                                  .lora_B.weight [out, r]

Every problem is a :class:`LoRAError` naming the file and the field or tensor, raised before any
weight is kept: a bad adapter never reaches a step.
"""
from __future__ import annotations

import hashlib
import json
import math
import pathlib
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from backend.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


class LoRAError(ValueError):
    """An adapter that cannot be served (unreadable, unsupported or not matching the base model)."""


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each targetable projection of the base model."""
    q, kv, h, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


@dataclass
class LoRAAdapter:
    """One adapter's weights in the model's dtype/device: ``layers[i][module] = (A [r, in], B [out, r])``."""
    name: str
    path: str
    rank: int
    scale: float
    uid: str                      # name + content digest: the prefix-cache identity (kv_cache/block_pool.py)
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(repr=False)
    c_table: Any = field(default=None, repr=False, compare=False)   # the fused C step's copy (lora/fused.py)


def _config(path: pathlib.Path, max_rank: int) -> tuple[int, float, set[str]]:
    f = path / CONFIG_FILE
    try:
        cfg = json.loads(f.read_text())
    except FileNotFoundError:
        raise LoRAError(f"{f}: no such file (a PEFT adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    except (OSError, ValueError) as e:
        raise LoRAError(f"{f}: not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{f}: must be a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{f}: peft_type {cfg.get('peft_type')!r} is not LORA")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoRAError(f"{f}: field r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise LoRAError(f"{f}: field r={r} exceeds max_lora_rank={max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoRAError(f"{f}: field lora_alpha must be a number, got {alpha!r}")
    for key, ok in (("use_dora", False), ("fan_in_fan_out", False)):
        if cfg.get(key, ok) != ok:
            raise LoRAError(f"{f}: field {key}={cfg[key]!r} is not supported")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if cfg.get(key):
            raise LoRAError(f"{f}: field {key} is not supported (got {cfg[key]!r})")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"{f}: field bias={cfg['bias']!r} is not supported (only 'none')")
    targets = cfg.get("target_modules")
    if isinstance(targets, str) or not isinstance(targets, list) or not targets:
        raise LoRAError(f"{f}: field target_modules must be a list of names among {', '.join(TARGETS)}")
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise LoRAError(f"{f}: field target_modules names {unknown}, not among {', '.join(TARGETS)}")
    # rsLoRA scales by alpha / sqrt(r) (PEFT's use_rslora), plain LoRA by alpha / r.
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(scale), set(targets)


def load_adapter(name: str, path: str | pathlib.Path, cfg: ModelConfig, *, max_rank: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LoRAAdapter:
    """Read, validate and convert one adapter (raises LoRAError)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    root = pathlib.Path(path)
    if not root.is_dir():
        raise LoRAError(f"{root}: not a directory")
    rank, scale, targets = _config(root, max_rank)
    f = root / WEIGHTS_FILE
    try:
        raw = f.read_bytes()
        tensors = load(raw)
    except FileNotFoundError:
        raise LoRAError(f"{f}: no such file") from None
    except (OSError, SafetensorError, ValueError, RuntimeError) as e:
        raise LoRAError(f"{f}: not a readable safetensors file ({e})") from None
    shapes = module_shapes(cfg)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAError(f"{f}: tensor {key!r} is not a LoRA weight of a decoder projection")
        layer, parent, mod, ab = int(m[1]), m[2], m[3], m[4]
        if mod not in targets or _PARENT.get(mod) != parent:
            raise LoRAError(f"{f}: tensor {key!r} targets {parent}.{mod}, not in target_modules {sorted(targets)}")
        if layer >= cfg.num_layers:
            raise LoRAError(f"{f}: tensor {key!r}: layer {layer} but the base model has {cfg.num_layers}")
        fan_in, fan_out = shapes[mod]
        want = (rank, fan_in) if ab == "A" else (fan_out, rank)
        if tuple(t.shape) != want:
            raise LoRAError(f"{f}: tensor {key!r} has shape {list(t.shape)}, the base model needs {list(want)} "
                            f"(r={rank})")
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise LoRAError(f"{f}: tensor {key!r} must hold finite floating-point values")
        pairs.setdefault((layer, mod), {})[ab] = t
    if not pairs:
        raise LoRAError(f"{f}: holds no LoRA weights")
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(cfg.num_layers)]
    for (layer, mod), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise LoRAError(f"{f}: layer {layer} {mod} has no {missing} tensor")
        layers[layer][mod] = (ab["A"].to(device=device, dtype=dtype).contiguous(),
                              ab["B"].to(device=device, dtype=dtype).contiguous())
    # The config too: the same weights under another lora_alpha compute other KV.
    digest = hashlib.sha256((root / CONFIG_FILE).read_bytes() + raw).hexdigest()[:16]
    return LoRAAdapter(name=name, path=str(root), rank=rank, scale=scale, uid=f"{name}@{digest}", layers=layers)
