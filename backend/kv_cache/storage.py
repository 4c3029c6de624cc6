"""The KV tensors themselves: one preallocated pool for every layer.

Layout (shared with ``kernels/``)::

    kv[layer, 0] = K cache  [num_blocks, block_size, num_kv_heads, head_dim]
    kv[layer, 1] = V cache  [num_blocks, block_size, num_kv_heads, head_dim]

    slot = block_id * block_size + offset_in_block
"""
from __future__ import annotations

import torch


class KVCacheStorage:
    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        raise NotImplementedError  # implemented in the KV-cache work

    @staticmethod
    def bytes_per_block(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        raise NotImplementedError

    def k_cache(self, layer: int) -> torch.Tensor:  # [num_blocks, block_size, num_kv_heads, head_dim]
        raise NotImplementedError

    def v_cache(self, layer: int) -> torch.Tensor:
        raise NotImplementedError

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K and V in every layer (copy-on-write)."""
        raise NotImplementedError

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Content of blocks as a host tensor [len(ids), num_layers, 2, block_size, kv_heads, head_dim]."""
        raise NotImplementedError

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        raise NotImplementedError
