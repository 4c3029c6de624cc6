"""What a checkpoint will weigh once served: the quantization summary and the engine config's
``weights_*`` parameters, planned on the meta device without reading a weight. It sits above the
loader and the model (``backend.quant.apply`` sits below them)."""
from __future__ import annotations

import pathlib

import torch

from backend import protocol as P
from backend.model.config import load_model_config
from backend.model.llama import LlamaForCausalLM
from backend.model.loader import parse_dtype
from backend.quant.apply import (_head_method, _linears, checkpoint_quant_config, method_of, module_dtypes,
                                 prepare_quantized, summary)
from backend.quant.layout import METHODS, check_group_size, stored_group
from backend.quant.linear import QuantLinear


def planned_summary(model_dir: str | pathlib.Path, *, dtype: torch.dtype, quantization: str = "none",
                    group_size: int = 32, lm_head: bool = False) -> dict:
    """What :func:`summary` will say of the model ``load_model`` builds from ``model_dir`` with these
    options, without reading a weight: the same modules on the meta device, sized with the dtypes
    the loader materializes. generate_repository() writes it into the engine's config, which is
    how the shim's ``/v1/models`` learns the weight bytes before (and without) loading anything."""
    if quantization not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)} (got {quantization!r})")
    qc = checkpoint_quant_config(model_dir)
    if qc is not None and quantization not in ("none", method_of(qc)):
        raise ValueError(f"{model_dir} is already quantized ({method_of(qc)}); "
                         f"quantization={quantization} cannot apply (use none or {method_of(qc)})")
    with torch.device("meta"):
        model = LlamaForCausalLM(load_model_config(model_dir), rotary=None)
        if qc is not None:
            prepare_quantized(model, qc)
        elif quantization != "none":
            check_group_size(quantization, group_size)
            for parent, attr, lin in _linears(model):
                n, k = lin.weight.shape
                setattr(parent, attr, QuantLinear(k, n, lin.bias is not None, quantization,
                                                  stored_group(quantization, group_size, k)))
        if lm_head:
            method, group = _head_method(model_dir, quantization, group_size, qc)
            vocab, hidden = model.lm_head_weight().shape
            model.lm_head_q = QuantLinear(hidden, vocab, False, method, hidden if group is None else group)
    seen: set[int] = set()
    nbytes = 0
    for module in model.modules():
        dtypes = module_dtypes(module, dtype)
        for name, p in module._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                nbytes += p.numel() * torch.empty((), dtype=dtypes[name]).element_size()
    out = summary(model)
    out["weight_bytes"] = nbytes
    return out


def reported_parameters(model_dir: str | pathlib.Path, args) -> dict[str, str]:
    """The engine config's weights parameters (backend/protocol.py WEIGHTS_PARAMS) for a checkpoint
    served with ``args`` (backend.config.EngineConfig)."""
    dtype = parse_dtype(args.dtype, args.device)
    s = planned_summary(model_dir, dtype=dtype, quantization=args.quantization, group_size=args.quant_group_size,
                        lm_head=args.head_quantized)
    return {P.WEIGHTS_DTYPE: str(dtype).removeprefix("torch."), P.WEIGHTS_QUANTIZATION: s["method"],
            P.WEIGHTS_GROUP_SIZE: "" if s["group_size"] is None else str(s["group_size"]),
            P.WEIGHT_BYTES: str(s["weight_bytes"])}
