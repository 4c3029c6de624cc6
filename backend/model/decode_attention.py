"""Paged attention for single-token (decode) queries on CPU, in plain torch.

Why not ``kernels.reference.paged_attention_ref`` for decodes: it gathers the whole padded KV
history of every decode into fresh tensors and runs SDPA with ``q_len = 1``, whose CPU kernels are
tuned for long queries; per layer that is ~3x slower than this. Here the sequences go through in
chunks sized to stay in cache: gather one chunk's blocks into reused buffers, then the two
contractions as broadcast multiply + sum, in fp32 (a batch of GEMVs is memory-bound anyway)::

    K chunk  [n, L, Hkv, 1, D]  *  q [n, 1, Hkv, G, D]  --sum D-->   scores [n, L, Hkv, G]
    softmax over L (keys past a sequence's length masked with -inf)
    probs [n, L, Hkv, G, 1]  *  V chunk [n, L, Hkv, 1, D]  --sum L-->  out [n, Hkv, G, D]

``L`` is the chunk's longest context rounded up to whole blocks. Sequences are taken in order of
length so a chunk pads little.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

CHUNK_BYTES = 2 << 20      # per-chunk product temp; measured best of 0.25-16 MiB on the 2-core host


@dataclass
class DecodePlan:
    """Per-step host-side bookkeeping, shared by every layer."""
    rows: torch.Tensor              # [B] query rows of the decode sequences, longest first
    chunks: list[tuple[int, int, int]]   # (start, end, num_blocks) into `rows` order
    block_ids: torch.Tensor         # [B, max_blocks] int64, rows in `rows` order
    neg_mask: torch.Tensor          # [B, max_blocks * block_size] fp32: 0 or -inf past the length
    # Scratch buffers reused by every layer of the step (fresh multi-MiB tensors per layer would
    # cost page faults each time).
    scratch: dict = field(default_factory=dict, repr=False)

    def buffer(self, name: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        buf = self.scratch.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = self.scratch[name] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]


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
    f32 = torch.float32
    # Math in fp32 whatever the cache dtype: CPU elementwise bf16 ops convert internally and are
    # slower than converting each gathered chunk once.
    q = query.index_select(0, plan.rows).to(f32).view(-1, 1, hkv, g, d)
    result = torch.empty(q.shape[0], hkv, g, d, dtype=f32, device=query.device)
    dev, convert = query.device, k_cache.dtype != f32
    for s, e, nb in plan.chunks:
        n, span = e - s, nb * block_size
        ids = plan.block_ids[s:e, :nb].reshape(-1)
        shape, size = (n * nb, block_size, hkv, d), n * span * hkv * d
        k = torch.index_select(k_cache, 0, ids, out=plan.buffer("k", size, k_cache.dtype, dev).view(shape))
        v = torch.index_select(v_cache, 0, ids, out=plan.buffer("v", size, v_cache.dtype, dev).view(shape))
        if convert:
            k = plan.buffer("k32", size, f32, dev).view(shape).copy_(k)
            v = plan.buffer("v32", size, f32, dev).view(shape).copy_(v)
        k, v = k.view(n, span, hkv, 1, d), v.view(n, span, hkv, 1, d)
        prod = plan.buffer("prod", size * g, f32, dev).view(n, span, hkv, g, d)
        torch.mul(k, q[s:e], out=prod)
        scores = prod.sum(-1)                                           # [n, span, Hkv, G]
        scores.mul_(scale).add_(plan.neg_mask[s:e, :span, None, None])
        probs = scores.softmax(dim=1)
        torch.mul(probs.unsqueeze(-1), v, out=prod)
        torch.sum(prod, 1, out=result[s:e])
    out.index_copy_(0, plan.rows, result.view(-1, hkv * g, d).to(out.dtype))
