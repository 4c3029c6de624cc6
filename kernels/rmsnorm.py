"""Fused (residual add +) RMSNorm: one read of x (and residual), one write of each output.

Grid: (cdiv(num_tokens, BLOCK_T),); a program normalises BLOCK_T rows of ``hidden`` values.
Numerics follow transformers' LlamaRMSNorm: statistics in fp32, the normalised row cast to
the input dtype, then multiplied by the weight (so bf16 results match it bit for bit).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import check_device, interpreted
from .tl_utils import cast_rtne


@triton.jit
def _rms_norm_kernel(
    x_ptr,          # [num_tokens, hidden]
    res_ptr,        # [num_tokens, hidden]  (HAS_RESIDUAL)
    w_ptr,          # [hidden]
    out_ptr,        # [num_tokens, hidden]
    res_out_ptr,    # [num_tokens, hidden]  x + residual (HAS_RESIDUAL)
    num_tokens, hidden, eps,
    stride_x, stride_r, stride_o, stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,      # next_power_of_2(hidden)
    INTERPRET: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < num_tokens)[:, None] & (cols < hidden)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + r64 * stride_r + cols[None, :], mask=mask, other=0.0)
        # rounded to the input dtype, as torch's x + residual is
        x = cast_rtne(x.to(tl.float32) + r.to(tl.float32), x_ptr.dtype.element_ty, INTERPRET)
        tl.store(res_out_ptr + r64 * stride_ro + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 1) / hidden + eps)
    normed = cast_rtne(xf * inv[:, None], x_ptr.dtype.element_ty, INTERPRET).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    y = cast_rtne(normed * w[None, :], out_ptr.dtype.element_ty, INTERPRET)
    tl.store(out_ptr + r64 * stride_o + cols[None, :], y, mask=mask)


def rms_norm(*,
             x: torch.Tensor,                      # [num_tokens, hidden]
             weight: torch.Tensor,                 # [hidden]
             eps: float,
             residual: torch.Tensor | None = None,  # [num_tokens, hidden]
             ):
    """Returns ``normed``, or ``(normed, x + residual)`` when ``residual`` is given."""
    check_device(x)
    num_tokens, hidden = x.shape
    assert x.stride(1) == 1 and weight.shape == (hidden,), (x.stride(), weight.shape)
    out = torch.empty(num_tokens, hidden, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = torch.empty_like(x) if residual is not None else out
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1
    if num_tokens:
        block_h = triton.next_power_of_2(hidden)
        block_t = max(1, min(64 if interpreted() else 4, 16384 // block_h))
        res = residual if residual is not None else x
        _rms_norm_kernel[(triton.cdiv(num_tokens, block_t),)](
            x, res, weight, out, res_out, num_tokens, hidden, eps,
            x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK_T=block_t, BLOCK_H=block_h, INTERPRET=interpreted(),
            num_warps=1 if interpreted() else min(16, max(4, block_h // 1024)),
        )
    return out if residual is None else (out, res_out)
