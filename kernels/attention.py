"""Paged attention for a mixed prefill/decode batch in one launch (varlen, causal, GQA).

Queries are flattened and unpadded; sequence s owns query rows
``cu_seqlens_q[s] : cu_seqlens_q[s+1]`` and its K/V live in the blocks ``block_tables[s]``.
Query i of a sequence with q_len new tokens and seq_len context tokens sits at absolute
position ``seq_len - q_len + i`` and attends to keys ``[0, that position]``.

Grid: (num_tokens // BLOCK_Q + num_seqs, num_kv_heads, num_kv_splits).  Sequence s owns the
query blocks starting at ``cu_seqlens_q[s] // BLOCK_Q + s`` (enough for ceil(q_len / BLOCK_Q)
blocks, the spare ones exit at once), so a program finds its sequence by binary search and
the host never reads the lengths.  A program's BLOCK_M rows are BLOCK_Q query tokens times
the G query heads that share one KV head, so K/V tiles are loaded once per group::

    row m  ->  token = q_block * BLOCK_Q + m // G_PAD,  q head = kv_head * G + m % G_PAD
    key j  ->  block_tables[s, j // block_size] * stride + (j % block_size) * stride

Online softmax in base 2 with fp32 accumulators.  With num_kv_splits > 1 each program covers
one slice of the key tiles and writes a normalised partial output and its log-sum-exp; a
second kernel merges the slices (split-KV / flash-decoding for few, long decodes).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import check_device, interpreted, num_sms
from .launch import LOG2E, plan_attention
from .tl_utils import cast_rtne


@triton.jit
def _find_seq(cu_q_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest s with cu_q[s] // BLOCK_Q + s <= q_block (the owner of this query block)."""
    lo = q_block * 0
    hi = num_seqs + lo
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(cu_q_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_seqs"])
def _paged_attention_kernel(
    q_ptr,              # [num_tokens, num_q_heads, head_dim]
    k_cache_ptr,        # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,        # [num_blocks, block_size, num_kv_heads, head_dim]
    out_ptr,            # [num_tokens, num_q_heads, head_dim]               (NUM_SPLITS == 1)
    part_out_ptr,       # [num_tokens, num_q_heads, NUM_SPLITS, HEAD_DIM_PAD] fp32 (NUM_SPLITS > 1)
    part_lse_ptr,       # [num_tokens, num_q_heads, NUM_SPLITS] fp32, log2-sum-exp2 of each slice
    block_tables_ptr,   # [num_seqs, max_blocks] int32
    cu_seqlens_q_ptr,   # [num_seqs + 1] int32
    seq_lens_ptr,       # [num_seqs] int32, context length including this step's tokens
    qk_scale,           # softmax scale * log2(e)
    num_seqs,
    max_blocks,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ko, stride_kh, stride_kd,
    stride_vb, stride_vo, stride_vh, stride_vd,
    stride_bt,
    G: tl.constexpr,            # query heads per KV head
    G_PAD: tl.constexpr,        # next_power_of_2(G)
    BLOCK_SIZE: tl.constexpr,   # tokens per cache block
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,      # query tokens per program; BLOCK_M = BLOCK_Q * G_PAD
    BLOCK_M: tl.constexpr,
    TILE: tl.constexpr,         # keys per inner-loop step
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,       # load everything as fp32 (interpreter: no bf16 in numpy)
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq(cu_seqlens_q_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq).to(tl.int32)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1).to(tl.int32) - q_start
    local = q_block - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    prefix = seq_len - q_len                      # tokens cached before this step

    m_idx = tl.arange(0, BLOCK_M)
    qi = local * BLOCK_Q + m_idx // G_PAD         # query index within the sequence
    g = m_idx % G_PAD
    row_ok = (qi < q_len) & (g < G)
    head = kv_head * G + g
    tok = (q_start + qi).to(tl.int64)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM

    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix + qi                           # absolute position of each row

    # Keys this query block can see: [0, kv_end).
    kv_end = prefix + tl.minimum(local * BLOCK_Q + BLOCK_Q, q_len)
    num_tiles = tl.cdiv(kv_end, TILE)
    if NUM_SPLITS == 1:
        tile_lo = 0
        tile_hi = num_tiles
    else:
        per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        tile_lo = split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

    for t in range(tile_lo, tile_hi):
        pos = t * TILE + tl.arange(0, TILE)
        pos_ok = pos < kv_end
        blk = tl.load(bt_row + tl.minimum(pos // BLOCK_SIZE, max_blocks - 1), mask=pos_ok, other=0)
        blk = blk.to(tl.int64)
        off = pos % BLOCK_SIZE
        k_ptrs = (k_cache_ptr + blk[None, :] * stride_kb + off[None, :] * stride_ko
                  + kv_head * stride_kh + d[:, None] * stride_kd)
        k = tl.load(k_ptrs, mask=d_ok[:, None] & pos_ok[None, :], other=0.0)   # [HEAD_DIM_PAD, TILE]
        v_ptrs = (v_cache_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vo
                  + kv_head * stride_vh + d[None, :] * stride_vd)
        v = tl.load(v_ptrs, mask=pos_ok[:, None] & d_ok[None, :], other=0.0)   # [TILE, HEAD_DIM_PAD]
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale           # [BLOCK_M, TILE]
        visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row may see no key yet
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_use = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_use[:, None]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(o_ptrs, cast_rtne(acc, out_ptr.dtype.element_ty, UPCAST),
                 mask=row_ok[:, None] & d_ok[None, :])
    else:
        # Empty slices still write (lse = -inf) so the merge never reads stale memory.
        part = (tok * (G * tl.num_programs(1)) + head) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM_PAD + d[None, :], acc,
                 mask=row_ok[:, None])
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_use), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    out_ptr,            # [num_tokens, num_q_heads, head_dim]
    part_out_ptr,       # [num_tokens, num_q_heads, NUM_SPLITS, HEAD_DIM_PAD] fp32
    part_lse_ptr,       # [num_tokens, num_q_heads, NUM_SPLITS] fp32
    num_q_heads,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    h_ok = h < num_q_heads
    hs_ok = h_ok[:, None] & (sp < NUM_SPLITS)[None, :]
    part = (tok * num_q_heads + h[:, None]) * NUM_SPLITS + sp[None, :]          # [BLOCK_H, SPLITS_PAD]

    lse = tl.load(part_lse_ptr + part, mask=hs_ok, other=float("-inf"))
    top = tl.max(lse, 1)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top[:, None])                                            # empty slice -> 0
    w_sum = tl.sum(w, 1)
    w_sum = tl.where(w_sum == 0.0, 1.0, w_sum)
    o = tl.load(part_out_ptr + part[:, :, None] * HEAD_DIM_PAD + d[None, None, :],
                mask=hs_ok[:, :, None], other=0.0)                             # [BLOCK_H, SPLITS_PAD, D]
    res = tl.sum(o * w[:, :, None], 1) / w_sum[:, None]
    o_ptrs = out_ptr + tok * stride_ot + h[:, None] * stride_oh + d[None, :] * stride_od
    tl.store(o_ptrs, cast_rtne(res, out_ptr.dtype.element_ty, INTERPRET),
             mask=h_ok[:, None] & (d < HEAD_DIM)[None, :])


def paged_attention(*,
                    query: torch.Tensor,          # [num_tokens, num_q_heads, head_dim]
                    k_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim]
                    v_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim]
                    block_tables: torch.Tensor,   # [num_seqs, max_blocks] int32
                    cu_seqlens_q: torch.Tensor,   # [num_seqs + 1] int32
                    seq_lens: torch.Tensor,       # [num_seqs] int32, context incl. new tokens
                    scale: float,
                    out: torch.Tensor | None = None,   # [num_tokens, num_q_heads, head_dim]
                    num_kv_splits: int | None = None,  # None: auto (decode-only batches on GPU)
                    max_seq_len: int | None = None,    # hint for the auto split; no device sync
                    ) -> torch.Tensor:
    check_device(query)
    num_tokens, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, kv_dim = k_cache.shape
    num_seqs = seq_lens.shape[0]
    assert v_cache.shape == k_cache.shape and kv_dim == head_dim, (k_cache.shape, query.shape)
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert cu_seqlens_q.shape == (num_seqs + 1,) and block_tables.shape[0] == num_seqs
    for name, t in (("block_tables", block_tables), ("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens)):
        assert t.dtype in (torch.int32, torch.int64), f"{name} must be int32 or int64, got {t.dtype}"
        assert t.device == query.device, f"{name} is on {t.device}, query on {query.device}"
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape, (out.shape, query.shape)
    if num_tokens == 0 or num_seqs == 0:
        return out

    interpret = interpreted()
    plan = plan_attention(
        dtype=query.dtype, num_tokens=num_tokens, num_seqs=num_seqs, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
        max_len=max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size,
        num_kv_splits=num_kv_splits, interpret=interpret,
        num_sms=1 if interpret else num_sms(query.device.index or 0))
    if plan.num_splits > 1:
        part_out = torch.empty(num_tokens, num_q_heads, plan.num_splits, plan.head_dim_pad,
                               dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_tokens, num_q_heads, plan.num_splits,
                               dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out       # unused
    _paged_attention_kernel[plan.grid](
        query, k_cache, v_cache, out, part_out, part_lse,
        block_tables, cu_seqlens_q, seq_lens,
        scale * LOG2E, num_seqs, block_tables.shape[1],
        *query.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0),
        **plan.constexprs, num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    if plan.num_splits > 1:
        _merge_splits_kernel[plan.merge_grid](
            out, part_out, part_lse, num_q_heads, *out.stride(),
            **plan.merge_constexprs, INTERPRET=interpret, num_warps=4,
        )
    return out
