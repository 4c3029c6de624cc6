"""Paged attention for single-token (decode) queries on CPU, in plain torch.

Why not ``kernels.reference.paged_attention_ref`` for decodes: it gathers the whole padded KV
history of every decode into fresh tensors and runs SDPA with ``q_len = 1``, whose CPU kernels are
tuned for long queries; per layer that is ~3x slower than this. Here the sequences go through in
chunks sized to stay in cache: gather one chunk's blocks into reused buffers, then the two
contractions as broadcast multiply + fp32 sum (a batch of GEMVs is memory-bound anyway)::

    K chunk  [n, L, Hkv, 1, D]  *  q [n, 1, Hkv, G, D]  --sum D-->   scores [n, L, Hkv, G]
    softmax over L (keys past a sequence's length masked with -inf)
    probs [n, L, Hkv, G, 1]  *  V chunk [n, L, Hkv, 1, D]  --sum L-->  out [n, Hkv, G, D]

``L`` is the chunk's longest context rounded up to whole blocks. Sequences are taken in order of
length so a chunk pads little.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK_BYTES = 4 << 20      # per-chunk working set (one score-product temp); fits a big L2 / L3 slice


@dataclass
class DecodePlan:
    """Per-step host-side bookkeeping, shared by every layer."""
    rows: torch.Tensor              # [B] query rows of the decode sequences, longest first
    chunks: list[tuple[int, int, int]]   # (start, end, num_blocks) into `rows` order
    block_ids: torch.Tensor         # [B, max_blocks] int64, rows in `rows` order
    neg_mask: torch.Tensor          # [B, max_blocks * block_size] fp32: 0 or -inf past the length


def plan_decode(rows: list[int], seq_lens: list[int], block_tables: torch.Tensor, block_size: int,
                row_bytes: int, device: torch.device | str = "cpu") -> DecodePlan:
    """rows/seq_lens: the decode sequences' query rows and context lengths (host lists, same order);
    block_tables: their [B, max_blocks] tables; row_bytes: bytes of one token's Hq*D product row."""
    order = sorted(range(len(rows)), key=lambda i: -seq_lens[i])
    lens = [seq_lens[i] for i in order]
    max_blocks = -(-lens[0] // block_size)
    ids = block_tables[torch.tensor(order, dtype=torch.int64, device=block_tables.device), :max_blocks]
    ids = ids.to(device=device, dtype=torch.int64)
    ids = ids.clamp_(0)       # table padding past a sequence's blocks is masked, but must index
    span = max_blocks * block_size
    pos = torch.arange(span)
    neg = torch.zeros(len(rows), span)
    neg.masked_fill_(pos[None, :] >= torch.tensor(lens)[:, None], float("-inf"))
    chunks, start = [], 0
    while start < len(lens):
        nb = -(-lens[start] // block_size)          # longest in the chunk comes first
        n = max(1, CHUNK_BYTES // (nb * block_size * row_bytes))
        end = min(len(lens), start + n)
        chunks.append((start, end, nb))
        start = end
    return DecodePlan(rows=torch.tensor([rows[i] for i in order], dtype=torch.int64, device=device),
                      chunks=chunks, block_ids=ids, neg_mask=neg.to(device))


def decode_attention(query: torch.Tensor,      # [num_tokens, Hq, D] (only plan.rows are read)
                     k_cache: torch.Tensor,    # [num_blocks, block_size, Hkv, D]
                     v_cache: torch.Tensor,
                     plan: DecodePlan, scale: float,
                     out: torch.Tensor) -> None:  # [num_tokens, Hq, D]; plan.rows are written
    _, block_size, hkv, d = k_cache.shape
    g = query.shape[1] // hkv
    q = query.index_select(0, plan.rows).view(-1, 1, hkv, g, d)
    result = torch.empty(q.shape[0], hkv, g, d, dtype=query.dtype, device=query.device)
    biggest = max((e - s) * nb for s, e, nb in plan.chunks)
    kbuf = k_cache.new_empty(biggest, block_size, hkv, d)
    vbuf = v_cache.new_empty(biggest, block_size, hkv, d)
    tmp = None
    for s, e, nb in plan.chunks:
        n, span = e - s, nb * block_size
        ids = plan.block_ids[s:e, :nb].reshape(-1)
        k = torch.index_select(k_cache, 0, ids, out=kbuf[:n * nb]).view(n, span, hkv, 1, d)
        v = torch.index_select(v_cache, 0, ids, out=vbuf[:n * nb]).view(n, span, hkv, 1, d)
        shape = (n, span, hkv, g, d)
        if tmp is None or tmp.numel() < n * span * hkv * g * d:
            tmp = torch.empty(shape, dtype=query.dtype, device=query.device)
        prod = tmp.view(-1)[:n * span * hkv * g * d].view(shape)
        torch.mul(k, q[s:e], out=prod)
        scores = prod.sum(-1, dtype=torch.float32)                      # [n, span, Hkv, G]
        scores.mul_(scale).add_(plan.neg_mask[s:e, :span, None, None])
        probs = scores.softmax(dim=1).to(query.dtype)
        torch.mul(probs.unsqueeze(-1), v, out=prod)
        result[s:e] = prod.sum(1, dtype=torch.float32)
    out.index_copy_(0, plan.rows, result.view(-1, hkv * g, d))
