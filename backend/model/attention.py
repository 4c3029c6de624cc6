"""Attention backends: write this step's K/V into the paged pool, then attend through block tables.

Both backends call the same keyword-only functions from ``kernels/`` (shapes in
``kernels/reference.py``)::

    TorchAttention   kernels.reference.store_kv_cache_ref + paged_attention_ref   (CPU default)
    TritonAttention  kernels.store_kv_cache + kernels.paged_attention              (CUDA, or CPU
                                                                                    under TRITON_INTERPRET=1)

The model calls ``backend.forward`` once per layer with that layer's cache views; everything
that is the same for all layers lives in :class:`AttentionMetadata`, built once per step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-step attention inputs shared by every layer (see BatchInput for the meaning)."""
    slot_mapping: torch.Tensor    # [num_tokens] int64, -1 = do not store
    block_tables: torch.Tensor    # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor    # [num_seqs + 1] int32
    seq_lens: torch.Tensor        # [num_seqs] int32, context incl. this step's tokens
    max_seqlen_q: int = 0         # host ints: let kernels size their grids without a device sync
    max_seq_len: int = 0

    @property
    def decode_only(self) -> bool:
        return self.max_seqlen_q == 1


class AttentionBackend:
    name = "base"

    def forward(self, query: torch.Tensor,    # [num_tokens, num_q_heads, head_dim]
                key: torch.Tensor,            # [num_tokens, num_kv_heads, head_dim]
                value: torch.Tensor,          # [num_tokens, num_kv_heads, head_dim]
                k_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim]
                v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Store key/value at ``meta.slot_mapping``, return causal attention [num_tokens, Hq, D]."""
        raise NotImplementedError


class TorchAttention(AttentionBackend):
    """The torch reference: gathers each sequence's blocks and runs SDPA (one call for all decodes)."""
    name = "torch"

    def __init__(self):
        from kernels.reference import paged_attention_ref, store_kv_cache_ref
        self._store, self._attend = store_kv_cache_ref, paged_attention_ref

    def forward(self, query, key, value, k_cache, v_cache, meta, scale):
        self._store(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=meta.slot_mapping)
        return self._attend(query=query, k_cache=k_cache, v_cache=v_cache, block_tables=meta.block_tables,
                            cu_seqlens_q=meta.cu_seqlens_q, seq_lens=meta.seq_lens, scale=scale,
                            max_seq_len=meta.max_seq_len or None)


class TritonAttention(AttentionBackend):
    """OpenAI-Triton kernels: paged attention straight from the pool, no gather copies."""
    name = "triton"

    def __init__(self):
        import kernels  # imported late: TRITON_INTERPRET is read when kernels/ is imported
        self._store, self._attend = kernels.store_kv_cache, kernels.paged_attention

    def forward(self, query, key, value, k_cache, v_cache, meta, scale):
        self._store(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=meta.slot_mapping)
        return self._attend(query=query, k_cache=k_cache, v_cache=v_cache, block_tables=meta.block_tables,
                            cu_seqlens_q=meta.cu_seqlens_q, seq_lens=meta.seq_lens, scale=scale,
                            max_seq_len=meta.max_seq_len or None)


def make_attention_backend(name: str, device: str | torch.device) -> AttentionBackend:
    """``auto``: Triton on CUDA, torch elsewhere. ``triton`` on CPU needs TRITON_INTERPRET=1."""
    from kernels.device import triton_available

    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"attention_backend must be auto, torch or triton (got {name!r})")
    kind = torch.device(device).type
    if name == "auto":
        name = "triton" if kind == "cuda" and triton_available("cuda") else "torch"
    if name == "triton":
        if not triton_available(kind):
            raise ValueError(f"attention_backend='triton' cannot run on {kind} here: it needs CUDA, or "
                             "TRITON_INTERPRET=1 set before start-up for CPU (slow, for tests)")
        return TritonAttention()
    return TorchAttention()
