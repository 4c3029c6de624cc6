"""Rotary position embedding applied in place to query and key (neox layout: rotate halves).

Grid: (cdiv(num_tokens, BLOCK_T), 2): axis 1 picks query or key.  A program rotates BLOCK_T
tokens x all heads of one tensor, with cos/sin rows looked up by each token's position::

    x = [x1 | x2] (halves of head_dim)  ->  [x1 * cos - x2 * sin | x2 * cos + x1 * sin]

Computed in fp32 and rounded once; query/key may be strided views of a fused QKV output.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import check_device, interpreted
from .tl_utils import cast_rtne


@triton.jit
def _rope_kernel(
    q_ptr,          # [num_tokens, num_q_heads, head_dim]
    k_ptr,          # [num_tokens, num_kv_heads, head_dim]
    cos_ptr,        # [max_positions, head_dim // 2]
    sin_ptr,        # [max_positions, head_dim // 2]
    pos_ptr,        # [num_tokens] int32/int64
    num_tokens, num_q_heads, num_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
    HALF: tl.constexpr,         # head_dim // 2
    HALF_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,    # next_power_of_2(max(num_q_heads, num_kv_heads))
    BLOCK_T: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    is_key = tl.program_id(1) == 1
    heads = tl.where(is_key, num_kv_heads, num_q_heads)
    stride_t = tl.where(is_key, stride_kt, stride_qt)
    stride_h = tl.where(is_key, stride_kh, stride_qh)
    h = tl.arange(0, HEADS_PAD)
    j = tl.arange(0, HALF_PAD)
    t_ok = tok < num_tokens
    pos = tl.load(pos_ptr + tok, mask=t_ok, other=0).to(tl.int64)
    cs_mask = t_ok[:, None] & (j < HALF)[None, :]
    c = tl.load(cos_ptr + pos[:, None] * stride_cos + j[None, :], mask=cs_mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos[:, None] * stride_sin + j[None, :], mask=cs_mask, other=0.0).to(tl.float32)
    c, s = c[:, None, :], s[:, None, :]                                        # [BLOCK_T, 1, HALF_PAD]
    offs = (tok.to(tl.int64)[:, None, None] * stride_t + h[None, :, None] * stride_h + j[None, None, :])
    mask = t_ok[:, None, None] & (h < heads)[None, :, None] & (j < HALF)[None, None, :]
    if is_key:
        base = k_ptr
    else:
        base = q_ptr
    x1 = tl.load(base + offs, mask=mask, other=0.0)
    x2 = tl.load(base + offs + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(base + offs, cast_rtne(x1 * c - x2 * s, dt, INTERPRET), mask=mask)
    tl.store(base + offs + HALF, cast_rtne(x2 * c + x1 * s, dt, INTERPRET), mask=mask)


def rope(*,
         query: torch.Tensor,      # [num_tokens, num_q_heads, head_dim], rotated in place
         key: torch.Tensor,        # [num_tokens, num_kv_heads, head_dim], rotated in place
         cos: torch.Tensor,        # [max_positions, head_dim // 2]
         sin: torch.Tensor,        # [max_positions, head_dim // 2]
         positions: torch.Tensor,  # [num_tokens] int32/int64
         ) -> None:
    check_device(query)
    num_tokens, hq, head_dim = query.shape
    hkv = key.shape[1]
    half = head_dim // 2
    assert key.shape == (num_tokens, hkv, head_dim) and head_dim % 2 == 0
    assert query.stride(2) == 1 and key.stride(2) == 1 and cos.stride(1) == 1 and sin.stride(1) == 1
    assert cos.shape[1] == half and sin.shape[1] == half, (cos.shape, head_dim)
    if num_tokens == 0:
        return
    heads_pad = triton.next_power_of_2(max(hq, hkv))
    half_pad = triton.next_power_of_2(half)
    block_t = max(1, min(64 if interpreted() else 4, 16384 // (heads_pad * half_pad)))
    _rope_kernel[(triton.cdiv(num_tokens, block_t), 2)](
        query, key, cos, sin, positions, num_tokens, hq, hkv,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos.stride(0), sin.stride(0),
        HALF=half, HALF_PAD=half_pad, HEADS_PAD=heads_pad, BLOCK_T=block_t, INTERPRET=interpreted(),
    )
