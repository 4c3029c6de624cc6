"""GGUF Q8_0 / Q4_0 / Q4_1 blocks -> our int8 / int4 layouts, bytes moved, never through fp32.

GGUF rows are runs of 32-value blocks (:attr:`GGUFTensor.raw`: uint8 [rows, blocks * block bytes],
already un-permuted by the reader)::

    Q8_0  34 B: d fp16, q int8[32]                 W = q * d
    Q4_0  18 B: d fp16, qs[16]                     W = (q - 8) * d
    Q4_1  20 B: d fp16, m fp16, qs[16]             W = q * d + m = (q - 8) * d + (m + 8 d)

with q of a Q4 block in our order already (byte j: value j low, value j + 16 high). So Q8_0 is
int8 with group 32, Q4_0 is int4 with zero 0, and Q4_1 is int4 with zero m + 8d: the one value
computed (in fp32, rounded to fp16: within half an fp16 ulp of the exact zero). Scales and q bytes
are copied as they are.
"""
from __future__ import annotations

import numpy as np
import torch

from backend.quant.layout import QuantWeight

BLOCK = 32
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
METHOD = {"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4"}


def _blocks(raw: np.ndarray, rows: int, qtype: str) -> np.ndarray:
    b = np.asarray(raw, dtype=np.uint8).reshape(rows, -1)
    return b.reshape(rows, b.shape[1] // BLOCK_BYTES[qtype], BLOCK_BYTES[qtype])


def to_quant(qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantWeight:
    """One GGUF matrix (HF shape [out, in]) in our layout; ValueError for other types."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"GGUF type {qtype} has no direct mapping (only {', '.join(BLOCK_BYTES)})")
    n, k = shape
    if k % BLOCK:
        raise ValueError(f"GGUF {qtype} rows of {k} values are not whole 32-blocks")
    b = _blocks(raw, n, qtype)
    d = torch.from_numpy(np.ascontiguousarray(b[:, :, 0:2]).view(np.float16)[..., 0].copy())
    if qtype == "Q8_0":
        q = torch.from_numpy(np.ascontiguousarray(b[:, :, 2:]).view(np.int8).reshape(n, k).copy())
        return QuantWeight("int8", q, d, None, BLOCK, k)
    if qtype == "Q4_0":
        qs, zero = b[:, :, 2:], torch.zeros_like(d)
    else:
        m = torch.from_numpy(np.ascontiguousarray(b[:, :, 2:4]).view(np.float16)[..., 0].copy())
        qs, zero = b[:, :, 4:], (m.float() + 8 * d.float()).half()
    packed = torch.from_numpy(np.ascontiguousarray(qs).reshape(n, -1).copy())
    return QuantWeight("int4", packed, d, zero, BLOCK, k)


def _projection(name: str) -> bool:
    return ".layers." in name and name.endswith("_proj.weight")


def choose_method(tensors) -> str:
    """int8 when most projection weights are Q8_0, else int4 (Q4_0 / Q4_1 / anything else)."""
    kinds = [METHOD.get(t.qtype, "int4") for t in tensors if _projection(t.name)]
    return "int8" if kinds.count("int8") > len(kinds) / 2 else "int4"


def quantized_state(tensors, dtype: str, progress=None) -> tuple[dict, dict, dict]:
    """(state dict for safetensors, quantization_config, counts) of a GGUF's tensors.

    Projection weights of the chosen method's GGUF types are mapped block for block; any other
    projection type (a K-quant, Q5, a Q8_0 in a Q4 file) is dequantized alone and re-quantized
    (counted as ``requantized``). Everything else (embeddings, norms, LM head) is dequantized to
    ``dtype``, as the engine keeps it in the model dtype anyway."""
    from backend.quant.layout import quantize_int4, quantize_int8

    method = choose_method(tensors)
    state, counts = {}, {"mapped": 0, "requantized": 0, "float": 0}
    target = getattr(torch, dtype)
    for i, t in enumerate(tensors):
        if _projection(t.name):
            if METHOD.get(t.qtype) == method:
                qw = to_quant(t.qtype, t.raw, t.shape)
                counts["mapped"] += 1
            else:
                w = torch.from_numpy(t.dequantize())        # one tensor, then dropped
                qw = quantize_int8(w, BLOCK) if method == "int8" else quantize_int4(w, BLOCK)
                counts["requantized"] += 1
            stem = t.name[: -len(".weight")]
            state[f"{stem}.qweight"], state[f"{stem}.scales"] = qw.qweight, qw.scales
            if qw.zeros is not None:
                state[f"{stem}.zeros"] = qw.zeros
        else:
            state[t.name] = torch.from_numpy(t.dequantize()).to(target).contiguous()
            counts["float"] += 1
        if progress and (i + 1) % 50 == 0:
            progress(f"  {i + 1} tensors converted")
    qc = {"quant_method": "triton_llm", "bits": 8 if method == "int8" else 4, "group_size": BLOCK,
          "source": "gguf:" + "/".join(sorted({t.qtype for t in tensors if _projection(t.name)}))}
    return state, qc, counts
