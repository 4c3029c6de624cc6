"""The KV tensors themselves: one preallocated pool for every layer.

Layout (shared with ``kernels/``)::

    kv[layer, 0] = K cache  [num_blocks, block_size, num_kv_heads, head_dim]
    kv[layer, 1] = V cache  [num_blocks, block_size, num_kv_heads, head_dim]

    slot = block_id * block_size + offset_in_block

A block's full content (every layer, K and V) is ``kv[:, :, block_id]`` with shape
``block_shape = [num_layers, 2, block_size, num_kv_heads, head_dim]``; that is the unit the
offload tiers store.
"""
from __future__ import annotations

import torch


class KVCacheStorage:
    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        for name, v in (("num_layers", num_layers), ("num_blocks", num_blocks), ("block_size", block_size),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if v <= 0:
                raise ValueError(f"{name} must be positive, got {v}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        # Zeros, not empty: a never-written slot read by a buggy kernel shows up as 0, not as NaN noise.
        self.kv = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim,
                              dtype=dtype, device=device)

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block's content as returned by :meth:`read_blocks` (per block)."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_block(num_layers=self.num_layers, block_size=self.block_size,
                                    num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype)

    @staticmethod
    def bytes_per_block(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """Device bytes of one block (K and V, all layers): num_blocks = budget // this."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize

    def k_cache(self, layer: int) -> torch.Tensor:  # [num_blocks, block_size, num_kv_heads, head_dim]
        return self.kv[layer, 0]

    def v_cache(self, layer: int) -> torch.Tensor:  # [num_blocks, block_size, num_kv_heads, head_dim]
        return self.kv[layer, 1]

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K and V in every layer (copy-on-write)."""
        self.kv[:, :, dst].copy_(self.kv[:, :, src])

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Content of blocks as a host tensor [len(ids), num_layers, 2, block_size, kv_heads, head_dim]."""
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=self.kv.device)
        out = self.kv.index_select(2, idx)            # [L, 2, n, bs, H, D]
        return out.permute(2, 0, 1, 3, 4, 5).to("cpu").contiguous()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of :meth:`read_blocks`: ``data`` is [len(ids), L, 2, bs, H, D] on any device."""
        if tuple(data.shape) != (len(block_ids), *self.block_shape):
            raise ValueError(f"write_blocks: expected {(len(block_ids), *self.block_shape)}, got {tuple(data.shape)}")
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=self.kv.device)
        self.kv[:, :, idx] = data.to(self.kv.device, self.dtype).permute(1, 2, 0, 3, 4, 5)
