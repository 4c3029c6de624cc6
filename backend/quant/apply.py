"""Swap the decoder's Linear layers for QuantLinear: after loading a float checkpoint, or before
loading a checkpoint that is already quantized (``quantization_config`` in its config.json).

Only the per-layer projections are quantized (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj``); the embeddings, the norms and the LM head stay in the model dtype (a tied head is
the embedding itself, and its error would land straight on the logits).

On-disk format of a quantized checkpoint (written by ``import-gguf --keep-quantized``): HF tensor
names with ``.qweight`` / ``.scales`` / ``.zeros`` in place of ``.weight`` (layouts in layout.py),
and in config.json::

    "quantization_config": {"quant_method": "triton_llm", "bits": 8 | 4, "group_size": G,
                            "source": "gguf:Q4_0"}
"""
from __future__ import annotations

import json
import pathlib

import torch
from torch import nn

from backend.quant.layout import METHODS, check_group_size, quantize, quantize_int8
from backend.quant.linear import QuantLinear

QUANT_METHOD = "triton_llm"
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _linears(model: nn.Module):
    """(parent module, attribute, module) for every quantizable projection."""
    for layer in model.model.layers:
        for path in PROJECTIONS:
            parent_name, attr = path.split(".")
            parent = getattr(layer, parent_name)
            yield parent, attr, getattr(parent, attr)


def checkpoint_quant_config(model_dir: str | pathlib.Path) -> dict | None:
    """The ``quantization_config`` of a checkpoint this package wrote, else None."""
    path = pathlib.Path(model_dir) / "config.json"
    try:
        qc = json.loads(path.read_text()).get("quantization_config")
    except (OSError, ValueError):
        return None
    if not qc:
        return None
    if qc.get("quant_method") != QUANT_METHOD:
        raise ValueError(f"{model_dir}: quantization_config quant_method {qc.get('quant_method')!r} "
                         f"is not supported (only {QUANT_METHOD!r}, written by import-gguf --keep-quantized)")
    return qc


def method_of(qc: dict) -> str:
    return {8: "int8", 4: "int4"}[int(qc["bits"])]


def prepare_quantized(model: nn.Module, qc: dict) -> None:
    """On a meta-device model: put QuantLinear skeletons where the checkpoint has quantized layers."""
    method, group = method_of(qc), int(qc["group_size"])
    for parent, attr, lin in _linears(model):
        setattr(parent, attr, QuantLinear(lin.weight.shape[1], lin.weight.shape[0], lin.bias is not None,
                                          method, group))


def quantize_model(model: nn.Module, method: str, group_size: int) -> None:
    """Quantize every projection in place, freeing each float weight as it goes."""
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)} (got {method!r})")
    if method == "none":
        return
    check_group_size(method, group_size)
    for parent, attr, lin in _linears(model):
        qw = quantize(lin.weight.data, method, group_size)
        setattr(parent, attr, QuantLinear.from_quant(qw, None if lin.bias is None else lin.bias.data))
        del lin


def _head_method(model_dir, quantization: str, group_size: int, qc: dict | None) -> tuple[str, int | None]:
    """(method, group) for quant_lm_head: the engine's quantization and group (int8 group None: per
    channel, ``quant_group_size`` 0),
    else the checkpoint's method and group. A GGUF Q8_0 file's head (its tied token_embd, Q8_0 like
    every matrix of that file) is imported dequantized; re-quantized on its own groups of 32 it
    gives back the file's bytes (d = max|w| / 127 of a group that was q * d with max|q| = 127), so
    ours reads the same head llama.cpp reads."""
    if quantization != "none":
        return quantization, None if quantization == "int8" and group_size == 0 else group_size
    if qc is not None:
        return method_of(qc), int(qc["group_size"])
    raise ValueError("quant_lm_head needs quantization=int8 or int4 (or a quantized checkpoint)")


def finish_load(model: nn.Module, model_dir, quantization: str, group_size: int, lm_head: bool = False) -> None:
    """The loader's hook: quantize a float checkpoint when asked; check a quantized one; with
    ``lm_head``, add a quantized copy of the LM head (``model.lm_head_q``: the embedding lookup of
    a tied head keeps the float table, the logits matmul reads the quantized copy)."""
    qc = checkpoint_quant_config(model_dir)
    if qc is None:
        quantize_model(model, quantization, group_size)
    elif quantization not in ("none", method_of(qc)):
        raise ValueError(f"{model_dir} is already quantized ({method_of(qc)}); "
                         f"quantization={quantization} cannot apply (use none or {method_of(qc)})")
    if lm_head:
        method, group = _head_method(model_dir, quantization, group_size, qc)
        w = model.lm_head_weight().data
        qw = quantize_int8(w, group) if method == "int8" else quantize(w, method, group)
        model.lm_head_q = QuantLinear.from_quant(qw, None)
    model.quantization = summary(model)


def summary(model: nn.Module) -> dict:
    """What /v1/models and the startup log report: method, group, weight bytes."""
    methods = {m.method for m in model.modules() if isinstance(m, QuantLinear)}
    groups = {m.group_size for m in model.modules() if isinstance(m, QuantLinear)}
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"method": methods.pop() if len(methods) == 1 else ("mixed" if methods else "none"),
            "group_size": groups.pop() if len(groups) == 1 else None,
            "weight_bytes": nbytes, "lm_head": getattr(model, "lm_head_q", None) is not None}


def module_dtypes(module: nn.Module, default: torch.dtype) -> dict[str, torch.dtype]:
    """dtype per parameter name for the loader's materialization (quantized tensors keep theirs)."""
    return {name: getattr(module, "param_dtypes", {}).get(name, default) for name in module._parameters}
