"""The context window: the longest sequence (prompt + generated tokens) the engine serves.

One definition, three limits:

    context_window = min(max_model_len or the model's own limit,     (config.json; a sliding-window
                         KV pool blocks * block_size)                  model only up to its window)

The pool bounds it because a sequence's blocks must all be resident at once: a longer one could
never be scheduled. Every consumer gets this number from here or is handed its result:

    engine          LLMEngine.max_model_len = context_window(...)  (admission, stop at the window)
    preprocessing   the ``context_window`` parameter generate_repository() writes into its config
    shim, chat page ask Triton for that parameter (TritonLLMClient.context_window())
"""
from __future__ import annotations

import pathlib

from backend.config import EngineConfig


def model_max_len(cfg, config: EngineConfig) -> int:
    """``config.max_model_len``, else what the model serves exactly (``cfg``: backend.model.config
    ModelConfig); ValueError past its position embeddings."""
    max_len = config.max_model_len or cfg.default_max_model_len()
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len={max_len} exceeds the model's max_position_embeddings="
                         f"{cfg.max_position_embeddings}")
    return max_len


def num_kv_blocks(cfg, config: EngineConfig) -> int:
    """Blocks in the device KV pool: ``num_kv_blocks``, else as many as ``kv_cache_memory`` holds
    (in the pool's element type: ``kv_cache_dtype`` fp16/bf16 fit twice the fp32 blocks)."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    from backend.kv_cache.storage import KVCacheStorage
    from backend.model.loader import kv_cache_torch_dtype

    per_block = KVCacheStorage.bytes_per_block(num_layers=cfg.num_layers, block_size=config.block_size,
                                               num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                               dtype=kv_cache_torch_dtype(config))
    return config.kv_cache_memory // per_block


def context_window(max_model_len: int, num_blocks: int, block_size: int) -> int:
    """The model's limit clamped to what one sequence can hold of the KV pool."""
    return min(max_model_len, num_blocks * block_size)


def context_window_for(model_dir: str | pathlib.Path, config: EngineConfig | None = None) -> int:
    """The engine's context window for a checkpoint and engine options, without loading weights
    (the same numbers ModelRunner and LLMEngine compute)."""
    from backend.model.config import load_model_config

    config = config or EngineConfig()
    cfg = load_model_config(model_dir)
    return context_window(model_max_len(cfg, config), num_kv_blocks(cfg, config), config.block_size)
