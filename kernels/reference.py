"""Torch references for the Triton kernels; also the engine's attention path on CPU.

Same keyword-only signatures as the kernels.  Cache layout (shared with backend/kv_cache)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]   (views kv[layer, 0|1])
    slot = block_id * block_size + offset_in_block

The attention reference gathers each sequence's blocks with ``index_select`` and calls
``scaled_dot_product_attention`` once for all decodes (padded, key-padding mask) and once per
prefill chunk (bottom-right-aligned causal mask when the chunk follows a cached prefix).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv_cache_ref(*,
                       key: torch.Tensor,           # [num_tokens, num_kv_heads, head_dim]
                       value: torch.Tensor,         # [num_tokens, num_kv_heads, head_dim]
                       k_cache: torch.Tensor,       # [num_blocks, block_size, num_kv_heads, head_dim]
                       v_cache: torch.Tensor,       # [num_blocks, block_size, num_kv_heads, head_dim]
                       slot_mapping: torch.Tensor,  # [num_tokens] int32/int64, -1 = skip
                       ) -> None:
    block_size = k_cache.shape[1]
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    blocks, offsets = slots // block_size, slots % block_size
    # Advanced-index assignment writes through the views into the shared pool.
    k_cache[blocks, offsets] = key.to(k_cache.dtype)
    v_cache[blocks, offsets] = value.to(v_cache.dtype)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """[num_blocks, bs, H, D] + [n] block ids -> [H, length, D] for one sequence."""
    tokens = cache.index_select(0, block_ids).flatten(0, 1)[:length]
    return tokens.transpose(0, 1)


def _sdpa(q, k, v, mask, scale, causal=False):
    """q [.., Hq, L, D], k/v [.., Hkv, S, D]; GQA through enable_gqa. A cache of another dtype
    than the query (kv_cache_dtype fp16 / bf16 under an fp32 model) is widened to the query's."""
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=causal,
                                          enable_gqa=q.shape[-3] != k.shape[-3])


def paged_attention_ref(*,
                        query: torch.Tensor,          # [num_tokens, num_q_heads, head_dim]
                        k_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim]
                        v_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim]
                        block_tables: torch.Tensor,   # [num_seqs, max_blocks] int32
                        cu_seqlens_q: torch.Tensor,   # [num_seqs + 1] int32
                        seq_lens: torch.Tensor,       # [num_seqs] int32, context incl. new tokens
                        scale: float,
                        out: torch.Tensor | None = None,  # [num_tokens, num_q_heads, head_dim]
                        num_kv_splits: int | None = None,  # ignored (kernel tuning knob)
                        max_seq_len: int | None = None,    # ignored (kernel tuning hint)
                        ) -> torch.Tensor:
    if out is None:
        out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or query.shape[0] == 0:
        return out
    block_size = k_cache.shape[1]
    starts = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    tables = block_tables.to(device=k_cache.device, dtype=torch.int64)

    decode = [s for s in range(num_seqs) if starts[s + 1] - starts[s] == 1]
    if decode:
        _decode_batch(query, k_cache, v_cache, tables, starts, lens, decode, block_size, scale, out)
    for s in range(num_seqs):
        q0, q1 = starts[s], starts[s + 1]
        q_len, kv_len = q1 - q0, lens[s]
        if q_len <= 1:
            continue
        n_blocks = -(-kv_len // block_size)
        ids = tables[s, :n_blocks]
        k = _gather(k_cache, ids, kv_len)
        v = _gather(v_cache, ids, kv_len)
        q = query[q0:q1].transpose(0, 1)                      # [Hq, q_len, D]
        if q_len == kv_len:                                    # no cached prefix: plain causal
            o = _sdpa(q, k, v, None, scale, causal=True)
        else:
            # Query i sits at absolute position kv_len - q_len + i and sees keys [0, that].
            pos_q = torch.arange(kv_len - q_len, kv_len, device=q.device)
            mask = torch.arange(kv_len, device=q.device)[None, :] <= pos_q[:, None]
            o = _sdpa(q, k, v, mask, scale)
        out[q0:q1] = o.transpose(0, 1).to(out.dtype)
    return out


def _decode_batch(query, k_cache, v_cache, tables, starts, lens, seqs, block_size, scale, out):
    """All single-token sequences in one SDPA call, padded to the longest context."""
    rows = torch.tensor([starts[s] for s in seqs], device=query.device)
    kv_lens = torch.tensor([lens[s] for s in seqs], device=query.device)
    max_len = max(lens[s] for s in seqs)
    n_blocks = -(-max_len // block_size)
    ids = tables[seqs][:, :n_blocks]                              # [B, n_blocks]
    # Entries past a sequence's own blocks may hold anything: clamp, then mask the keys.
    ids = ids.clamp(0, k_cache.shape[0] - 1).reshape(-1)
    b = len(seqs)

    valid = torch.arange(max_len, device=query.device)[None, :] < kv_lens[:, None]   # [B, S]
    padded = not bool(valid.all())

    def gather(cache):
        t = cache.index_select(0, ids).view(b, n_blocks * block_size, *cache.shape[2:])[:, :max_len]
        if padded:  # stale slots may hold NaN, and 0 * NaN is NaN even under a -inf score
            t = t.masked_fill(~valid[:, :, None, None], 0)
        return t.transpose(1, 2)                                  # [B, Hkv, S, D]

    q = query.index_select(0, rows).unsqueeze(2)                  # [B, Hq, 1, D]
    mask = valid[:, None, None, :] if padded else None
    o = _sdpa(q, gather(k_cache), gather(v_cache), mask, scale)   # [B, Hq, 1, D]
    out.index_copy_(0, rows, o.squeeze(2).to(out.dtype))


def rms_norm_ref(*,
                 x: torch.Tensor,                      # [num_tokens, hidden]
                 weight: torch.Tensor,                 # [hidden]
                 eps: float,
                 residual: torch.Tensor | None = None,  # [num_tokens, hidden]
                 ):
    """Llama RMSNorm (fp32 statistics, cast back, then times weight), as transformers does it.

    With ``residual``: normalises ``x + residual`` and returns ``(normed, x + residual)``."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if residual is None else (normed, x)


def rope_ref(*,
             query: torch.Tensor,      # [num_tokens, num_q_heads, head_dim], rotated in place
             key: torch.Tensor,        # [num_tokens, num_kv_heads, head_dim], rotated in place
             cos: torch.Tensor,        # [max_positions, head_dim // 2]
             sin: torch.Tensor,        # [max_positions, head_dim // 2]
             positions: torch.Tensor,  # [num_tokens] int
             ) -> None:
    """Rotary embedding, neox layout: halves (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), in fp32."""
    c = cos.index_select(0, positions.long()).float().unsqueeze(1)
    s = sin.index_select(0, positions.long()).float().unsqueeze(1)
    for x in (query, key):
        x1, x2 = x.float().chunk(2, dim=-1)
        x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
