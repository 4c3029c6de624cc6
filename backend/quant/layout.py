"""Our quantized weight layouts, how a float weight becomes one, and the torch dequantizer.

Both layouts keep output rows first (``[N, ...]``), so the loader can fill a fused ``qkv_proj`` /
``gate_up_proj`` by row slices exactly as it does float weights, and a GGUF row (blocks + scales of
one output row) maps onto one of our rows.

    int8  qweight int8  [N, K]               W[n,k] = qweight[n,k] * scales[n, k // G]
          scales  fp16  [N, ceil(K / G)]     G = 32 (llama.cpp Q8_0's blocks: the default, and
                                             GGUF Q8_0 kept as it is) or K (one scale per
                                             output channel: quant_group_size=0)
    int4  qweight uint8 [N, ceil(K/32)*16]   blocks of 32 values; byte j of a block holds value j
                                             (low nibble) and value j + 16 (high nibble): GGUF
                                             Q4_0/Q4_1's order, so their bytes are used as they are
          scales, zeros fp16 [N, ceil(K/G)]  W[n,k] = (q[n,k] - 8) * scales[n,g] + zeros[n,g],
                                             g = k // G, G a multiple of 32

Scales are fp16 (as in GGUF) and q is computed against the *rounded* scale, so the stored pair is
self-consistent. int4 is asymmetric (min/max per group, as GGUF Q4_1): a zero point costs 2 bytes
per group and keeps one-sided groups from wasting half the grid. (A per-group clipping search was
tried and dropped: 5x the load-time cost for quantizing a 135M model, ~1.5 min on 2 cores.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

METHODS = ("none", "int8", "int4")
INT4_BLOCK = 32


@dataclass
class QuantWeight:
    """One quantized matrix of logical shape [out_features, in_features]."""
    method: str                    # int8 | int4
    qweight: torch.Tensor
    scales: torch.Tensor           # fp16 [N, NG]
    zeros: torch.Tensor | None     # fp16 [N, NG] (int4 only)
    group_size: int
    in_features: int

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros)
                   if t is not None)


def num_groups(k: int, group_size: int) -> int:
    return -(-k // group_size)


def check_group_size(method: str, group_size: int) -> None:
    if method == "int4" and (group_size <= 0 or group_size % INT4_BLOCK):
        raise ValueError(f"quant_group_size for int4 must be a positive multiple of 32 (got {group_size})")
    if method == "int8" and group_size < 0:
        raise ValueError(f"quant_group_size for int8 must be 0 (per output channel) or positive (got {group_size})")


def stored_group(method: str, group_size: int, k: int) -> int:
    """The group G a [N, K] weight is stored with: ``quant_group_size`` 0 means one scale per output
    channel for int8 (G = K)."""
    return k if method == "int8" and group_size == 0 else group_size


def _pad_groups(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (w [N, NG, G] zero-padded, valid mask of the same shape)."""
    n, k = w.shape
    ng = num_groups(k, group_size)
    pad = ng * group_size - k
    valid = torch.ones(n, k, dtype=torch.bool, device=w.device)
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
        valid = torch.nn.functional.pad(valid, (0, pad))
    return w.view(n, ng, group_size), valid.view(n, ng, group_size)


# The int8 scale search (csrc/w8_quantize.c runs the same rule): candidates r * absmax / 127, r = 1
# first, then the grid 1 + (i - 8) / 160 for i = 0..40 (0.95 .. 1.20); the least squared error wins,
# ties to the earlier candidate.
INT8_RATIOS = [1.0] + [1 + (i - 8) / 160 for i in range(41) if i != 8]


def quantize_int8(w: torch.Tensor, group_size: int | None = None, reference: bool = False) -> QuantWeight:
    """Symmetric int8 in [-127, 127]; one scale per output row (group_size None) or per group, the
    scale searched per group (INT8_RATIOS) for the least squared error. On CPU with the C library
    built (and not ``reference``) csrc/w8_quantize.c does it; this torch loop is its reference."""
    n, k = w.shape
    g = k if group_size is None else group_size
    if not reference and w.device.type == "cpu":
        from backend.quant import cpu
        got = cpu.quantize_int8(w, g)
        if got is not None:
            return QuantWeight("int8", got[0], got[1], None, g, k)
    q = torch.empty(n, num_groups(k, g) * g, dtype=torch.int8)
    scale = torch.empty(n, num_groups(k, g), dtype=torch.float16)
    for r0 in range(0, n, 256):                    # row chunks: the candidates' error tensors stay small
        wg, valid = _pad_groups(w[r0:r0 + 256].float(), g)
        base = wg.abs().amax(-1) / 127
        best_err = best_s = None
        for r in INT8_RATIOS:
            s = (base * torch.tensor(r, dtype=torch.float32)).half().float()
            # 2^-24: the smallest fp16 subnormal, so only a zero scale (an all-zero group) is lifted
            qc = torch.round(wg / s.clamp_min(2.0 ** -24).unsqueeze(-1)).clamp_(-127, 127)
            err = torch.where(valid, qc * s.unsqueeze(-1) - wg, 0).square().sum(-1)
            err = torch.where(s > 0, err, torch.inf)
            if best_err is None:
                best_err, best_s = err, s
            else:
                better = err < best_err
                best_err, best_s = torch.where(better, err, best_err), torch.where(better, s, best_s)
        qc = torch.round(wg / best_s.clamp_min(2.0 ** -24).unsqueeze(-1)).clamp_(-127, 127)
        q[r0:r0 + 256] = torch.where(best_s.unsqueeze(-1) > 0, qc, 0).to(torch.int8).view(wg.shape[0], -1)
        scale[r0:r0 + 256] = best_s.half()
    return QuantWeight("int8", q[:, :k].contiguous(), scale, None, g, k)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] values 0..15 -> packed uint8 [N, ceil(K/32)*16] in GGUF block order."""
    n, k = q.shape
    kb = num_groups(k, INT4_BLOCK)
    q = torch.nn.functional.pad(q, (0, kb * INT4_BLOCK - k), value=8).view(n, kb, 2, 16)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, kb * 16).contiguous()


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: uint8 [N, K] values 0..15."""
    n = packed.shape[0]
    b = packed.view(n, -1, 16)
    return torch.stack((b & 15, b >> 4), dim=2).reshape(n, -1)[:, :k]


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> QuantWeight:
    """Asymmetric group-wise int4 (min/max grid per group), fp16 scales/zeros."""
    check_group_size("int4", group_size)
    n, k = w.shape
    wg, valid = _pad_groups(w.float(), group_size)
    lo = torch.where(valid, wg, torch.inf).amin(-1)
    hi = torch.where(valid, wg, -torch.inf).amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8).half()
    zero = (lo + 8 * scale.float()).half()                # W = (q-8)*s + z: q = 0 maps to lo
    s, z = scale.float().unsqueeze(-1), zero.float().unsqueeze(-1)
    q = torch.round((wg - z) / s + 8).clamp_(0, 15).to(torch.uint8).view(n, -1)[:, :k]
    return QuantWeight("int4", pack_int4(q), scale, zero, group_size, k)


def quantize(w: torch.Tensor, method: str, group_size: int) -> QuantWeight:
    if method == "int8":
        check_group_size(method, group_size)
        return quantize_int8(w, None if group_size == 0 else group_size)
    if method == "int4":
        return quantize_int4(w, group_size)
    raise ValueError(f"quantization must be one of {', '.join(METHODS)} (got {method!r})")


def dequantize(qw: QuantWeight) -> torch.Tensor:
    """fp32 [N, K]: the reference every kernel is tested against."""
    k, g = qw.in_features, qw.group_size
    s = qw.scales.float().repeat_interleave(g, dim=1)[:, :k]
    if qw.method == "int8":
        return qw.qweight.float() * s
    z = qw.zeros.float().repeat_interleave(g, dim=1)[:, :k]
    return (unpack_int4(qw.qweight, k).float() - 8) * s + z
