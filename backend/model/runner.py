"""ModelRunner: loads a checkpoint, owns the KV storage, executes one flattened batch.

The engine builds one :class:`BatchInput` per step (sequences back to back, no padding) and gets
logits for the rows named by ``logits_indices``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.config import EngineArgs


@dataclass
class BatchInput:
    input_ids: torch.Tensor       # [num_tokens] int64
    positions: torch.Tensor       # [num_tokens] int64, absolute position of each token in its sequence
    slot_mapping: torch.Tensor    # [num_tokens] int64, KV slot each token's K/V is written to
    cu_seqlens_q: torch.Tensor    # [num_seqs + 1] int32, query start of each sequence
    seq_lens: torch.Tensor        # [num_seqs] int32, context length incl. this step's tokens
    block_tables: torch.Tensor    # [num_seqs, max_blocks] int32 (padded with 0)
    logits_indices: torch.Tensor  # [num_logits] int64, token rows whose logits are wanted
    max_seqlen_q: int = 0         # max query length in the batch (host int, avoids a sync)


@dataclass
class ModelInfo:
    """What the engine needs to know about the loaded model."""
    model_type: str
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    eos_token_ids: list[int]


class ModelRunner:
    def __init__(self, model_dir: str, args: EngineArgs):
        """Load config + weights (any HF Llama/Mistral/Qwen2 directory), pick the attention backend,
        size and allocate the KV pool (``self.storage``: KVCacheStorage, ``self.num_blocks``)."""
        raise NotImplementedError

    info: ModelInfo
    num_blocks: int

    @torch.inference_mode()
    def execute(self, batch: BatchInput) -> torch.Tensor:
        """Run the model on the batch, writing K/V into the pool; return fp32 logits [num_logits, vocab]."""
        raise NotImplementedError
