"""Builders for paged KV caches and mixed batches shared by the kernel tests."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """One attention step: the pool, its per-layer views and the flattened query batch."""
    kv: torch.Tensor            # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    k_cache: torch.Tensor       # kv[layer, 0]
    v_cache: torch.Tensor       # kv[layer, 1]
    query: torch.Tensor         # [num_tokens, num_q_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, -1 past each sequence's blocks
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor      # [num_seqs] int32

    def args(self, **extra):
        return dict(query=self.query, k_cache=self.k_cache, v_cache=self.v_cache,
                    block_tables=self.block_tables, cu_seqlens_q=self.cu_seqlens_q,
                    seq_lens=self.seq_lens, **extra)


def make_batch(q_lens, seq_lens, *, num_kv_heads=2, group=4, head_dim=64, block_size=16,
               dtype=torch.float32, device="cpu", layer=1, num_layers=2, spare_blocks=3,
               poison_unused=True) -> Batch:
    """Random pool with shuffled block ids; slots no sequence owns hold NaN (must never be read)."""
    assert len(q_lens) == len(seq_lens) and all(q <= s for q, s in zip(q_lens, seq_lens))
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    kv = torch.randn(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    perm = torch.randperm(num_blocks)
    max_blocks = max(blocks_per_seq) + 1
    tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    start = 0
    for s, (n, length) in enumerate(zip(blocks_per_seq, seq_lens)):
        ids = perm[start:start + n]
        start += n
        tables[s, :n] = ids.to(torch.int32)
        for p in range(length):
            used[ids[p // block_size], p % block_size] = True
    if poison_unused:
        kv[:, :, ~used] = float("nan")
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    query = torch.randn(int(cu[-1]), num_kv_heads * group, head_dim).to(dtype)
    kv = kv.to(device)
    return Batch(kv=kv, k_cache=kv[layer, 0], v_cache=kv[layer, 1], query=query.to(device),
                 block_tables=tables.to(device), cu_seqlens_q=cu.to(device),
                 seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device))


def naive_attention(b: Batch, scale: float) -> torch.Tensor:
    """Token by token in float64, straight from the definition (checks the reference itself)."""
    out = torch.empty(b.query.shape, dtype=torch.float64)
    bs = b.k_cache.shape[1]
    group = b.query.shape[1] // b.k_cache.shape[2]
    cu, lens, tables = b.cu_seqlens_q.tolist(), b.seq_lens.tolist(), b.block_tables.cpu()
    for s in range(len(lens)):
        q_len, kv_len = cu[s + 1] - cu[s], lens[s]
        pos = torch.arange(kv_len)
        blocks = tables[s].long()[pos // bs]
        k = b.k_cache.cpu()[blocks, pos % bs].double()        # [kv_len, Hkv, D]
        v = b.v_cache.cpu()[blocks, pos % bs].double()
        for i in range(q_len):
            p = kv_len - q_len + i
            q = b.query[cu[s] + i].cpu().double()              # [Hq, D]
            kk = k[:p + 1].repeat_interleave(group, dim=1)     # [p+1, Hq, D]
            vv = v[:p + 1].repeat_interleave(group, dim=1)
            w = torch.softmax(torch.einsum("hd,thd->ht", q, kk) * scale, dim=-1)
            out[cu[s] + i] = torch.einsum("ht,thd->hd", w, vv)
    return out
