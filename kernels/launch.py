"""Launch plans: grid, block sizes and compile-time constants for each kernel call.

Pure functions of the shapes, the dtype and the device kind, so the wrappers and the
cross-compile check (tests/kernels/cuda_compile.py) launch exactly the same variants.

Block sizes: the interpreter pays ~0.5 ms of Python per program and per loop step, so it
gets few, large blocks; a GPU gets tensor-core-sized ones (tl.dot needs M, N, K >= 16):
decode-only batches use BLOCK_M = 16 rows (1..16 tokens x G heads), batches with a
prefill use 64, and fp32 halves the key tile to stay inside shared memory on sm_80.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttentionPlan:
    """How one paged_attention call runs: the main kernel, then (split-KV only) the merge."""
    grid: tuple[int, int, int]          # (query blocks, kv heads, kv splits)
    constexprs: dict
    num_warps: int
    num_stages: int
    num_splits: int
    head_dim_pad: int
    merge_grid: tuple[int, int] | None = None    # (tokens, head blocks)
    merge_constexprs: dict | None = None


def auto_splits(*, programs: int, decode_only: bool, max_len: int, tile: int, num_sms: int) -> int:
    """Split the keys only when decodes alone cannot fill the GPU and contexts are long."""
    target = 2 * num_sms
    tiles = triton.cdiv(max_len, tile)
    if not decode_only or programs >= target or tiles < 8:
        return 1
    want = min(triton.cdiv(target, programs), tiles // 4, 16)
    return 1 << (want.bit_length() - 1)          # a power of two: few kernel variants


def plan_attention(*, dtype: torch.dtype, num_tokens: int, num_seqs: int, num_q_heads: int,
                   num_kv_heads: int, head_dim: int, block_size: int, max_len: int,
                   num_kv_splits: int | None, interpret: bool, num_sms: int) -> AttentionPlan:
    g = num_q_heads // num_kv_heads
    g_pad = triton.next_power_of_2(g)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    decode_only = num_tokens == num_seqs
    if interpret:
        block_m, tile, warps, stages = max(64, g_pad), 128, 1, 1
    else:
        block_m = max(16 if decode_only else 64, g_pad)
        tile = 64 if d_pad <= 128 and dtype != torch.float32 else 32
        warps, stages = 4, 2
    block_q = block_m // g_pad
    # Sequence s owns blocks [cu[s] // BLOCK_Q + s, cu[s+1] // BLOCK_Q + s + 1): see attention.py.
    num_q_blocks = num_tokens // block_q + num_seqs
    if num_kv_splits is None:
        num_kv_splits = 1 if interpret else auto_splits(
            programs=num_q_blocks * num_kv_heads, decode_only=decode_only, max_len=max_len,
            tile=tile, num_sms=num_sms)
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    constexprs = dict(
        G=g, G_PAD=g_pad, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad,
        BLOCK_Q=block_q, BLOCK_M=block_m, TILE=tile, NUM_SPLITS=num_kv_splits, UPCAST=interpret,
        # fp32 caches get exact fp32 products (tf32 would change greedy outputs); bf16/fp16 ignore it.
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
    )
    plan = dict(grid=(num_q_blocks, num_kv_heads, num_kv_splits), constexprs=constexprs,
                num_warps=warps, num_stages=stages, num_splits=num_kv_splits, head_dim_pad=d_pad)
    if num_kv_splits > 1:
        splits_pad = triton.next_power_of_2(num_kv_splits)
        budget = 65536 if interpret else 4096      # elements of the [heads, splits, dim] tile
        block_h = min(triton.next_power_of_2(num_q_heads), max(1, budget // (splits_pad * d_pad)))
        plan.update(merge_grid=(num_tokens, triton.cdiv(num_q_heads, block_h)),
                    merge_constexprs=dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad,
                                          NUM_SPLITS=num_kv_splits, SPLITS_PAD=splits_pad,
                                          BLOCK_H=block_h))
    return AttentionPlan(**plan)


def plan_store(*, num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int,
               interpret: bool) -> tuple[tuple[int], dict]:
    """(grid, constexprs) for store_kv_cache: BLOCK_T tokens x all their heads per program."""
    num_hd = num_kv_heads * head_dim
    block_hd = triton.next_power_of_2(num_hd)
    budget = 16384 if interpret else 4096
    block_t = max(1, min(64 if interpret else 16, budget // block_hd))
    return (triton.cdiv(num_tokens, block_t),), dict(
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, NUM_HD=num_hd, BLOCK_T=block_t, BLOCK_HD=block_hd)
