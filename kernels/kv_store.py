"""KV-cache write by slot mapping: copies this step's K/V into the paged pool.

Grid: (cdiv(num_tokens, BLOCK_T),).  A program takes BLOCK_T tokens and all their
num_kv_heads * head_dim values, flattened into one row of BLOCK_HD lanes::

    lane j  ->  head = j // head_dim, dim = j % head_dim
    slot    ->  block = slot // block_size, offset = slot % block_size   (slot < 0: skipped)

Every address is built from strides, so key/value may be views of a fused QKV output and
the caches views of the shared ``kv[layer, 0|1]`` pool.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import check_device, interpreted
from .launch import plan_store
from .tl_utils import cast_rtne


@triton.jit
def _store_kv_kernel(
    key_ptr,            # [num_tokens, num_kv_heads, head_dim]
    value_ptr,          # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,        # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,        # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_ptr,           # [num_tokens] int32/int64
    num_tokens,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kco, stride_kch, stride_kcd,
    stride_vcb, stride_vco, stride_vch, stride_vcd,
    BLOCK_SIZE: tl.constexpr,   # tokens per cache block
    HEAD_DIM: tl.constexpr,
    NUM_HD: tl.constexpr,       # num_kv_heads * head_dim
    BLOCK_T: tl.constexpr,
    BLOCK_HD: tl.constexpr,     # next_power_of_2(NUM_HD)
    INTERPRET: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < num_tokens
    slot = tl.load(slot_ptr + tok, mask=tok_ok, other=-1).to(tl.int64)
    row_ok = tok_ok & (slot >= 0)
    slot = tl.where(row_ok, slot, 0)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE

    j = tl.arange(0, BLOCK_HD)
    head = j // HEAD_DIM
    dim = j % HEAD_DIM
    mask = row_ok[:, None] & (j < NUM_HD)[None, :]
    t64 = tok.to(tl.int64)[:, None]

    k = tl.load(key_ptr + t64 * stride_kt + head[None, :] * stride_kh + dim[None, :] * stride_kd,
                mask=mask, other=0.0)
    v = tl.load(value_ptr + t64 * stride_vt + head[None, :] * stride_vh + dim[None, :] * stride_vd,
                mask=mask, other=0.0)
    kc = (blk[:, None] * stride_kcb + off[:, None] * stride_kco
          + head[None, :] * stride_kch + dim[None, :] * stride_kcd)
    vc = (blk[:, None] * stride_vcb + off[:, None] * stride_vco
          + head[None, :] * stride_vch + dim[None, :] * stride_vcd)
    k = cast_rtne(k.to(tl.float32), k_cache_ptr.dtype.element_ty, INTERPRET)
    v = cast_rtne(v.to(tl.float32), v_cache_ptr.dtype.element_ty, INTERPRET)
    tl.store(k_cache_ptr + kc, k, mask=mask)
    tl.store(v_cache_ptr + vc, v, mask=mask)


def store_kv_cache(*,
                   key: torch.Tensor,           # [num_tokens, num_kv_heads, head_dim]
                   value: torch.Tensor,         # [num_tokens, num_kv_heads, head_dim]
                   k_cache: torch.Tensor,       # [num_blocks, block_size, num_kv_heads, head_dim]
                   v_cache: torch.Tensor,       # [num_blocks, block_size, num_kv_heads, head_dim]
                   slot_mapping: torch.Tensor,  # [num_tokens] int32/int64, -1 = skip
                   ) -> None:
    check_device(key)
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, (value.shape, key.shape)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert slot_mapping.shape == (num_tokens,), slot_mapping.shape
    if num_tokens == 0:
        return
    grid, constexprs = plan_store(num_tokens=num_tokens, num_kv_heads=num_kv_heads,
                                  head_dim=head_dim, block_size=k_cache.shape[1],
                                  interpret=interpreted())
    _store_kv_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping, num_tokens,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        **constexprs, INTERPRET=interpreted(),
    )
