"""ModelRunner: loads a checkpoint, owns the KV storage, executes one flattened batch.

The engine builds one :class:`BatchInput` per step (sequences back to back, no padding) and gets
logits for the rows named by ``logits_indices``.

:func:`build_batch` builds it from per-sequence chunks (the engine's step, tests, benchmarks).

Each chunk is "these new tokens of one sequence, after ``num_computed`` already cached tokens, with
this block table". Index arithmetic, for a sequence with ``num_computed=5`` and 3 new tokens,
``block_size=4`` and block table ``[7, 2]``::

    positions     5  6  7          (num_computed + i)
    block         2  2  2          (block_table[pos // block_size] -> table[1])
    slot          9 10 11          (block * block_size + pos % block_size)
    seq_len       8                (num_computed + new tokens)
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from backend.config import EngineConfig, LoRAConfig
from backend.context import model_max_len, num_kv_blocks
from backend.kv_cache.storage import KVCacheStorage
from backend.lora.registry import make_lora_registry
from backend.model.attention import AttentionMetadata, make_attention_backend
from backend.model.config import load_model_config
from backend.model.fused_decode import make_fused_decoder
from backend.model.loader import kv_cache_torch_dtype, load_model, parse_dtype
from backend.model.pooling import PoolingConfig


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
    max_seq_len: int = 0          # max of seq_lens (host int; a kernel launch hint, 0 = unknown)
    # [num_hidden] int64, rows whose final-normed hidden state is wanted (embedding requests,
    # backend/engine/embedding.py); None: none (every step that has no embedding request)
    hidden_indices: torch.Tensor | None = None
    # the step's tokens grouped by LoRA adapter (backend/lora/batch.py); None: base-model rows only
    lora: Any = None


@dataclass
class SeqChunk:
    token_ids: list[int]          # this step's new tokens of the sequence
    num_computed: int             # tokens of the sequence already in the KV cache
    block_table: list[int]        # block ids covering at least num_computed + len(token_ids) tokens
    all_logits: bool = False      # logits for every new token, not only the last
    logits: bool = True           # False: no logits row (a prefill chunk that does not sample yet)


def build_batch(chunks: list[SeqChunk], block_size: int, device: str | torch.device = "cpu") -> BatchInput:
    """All host lists first, then two tensors (the int64 fields, the int32 fields) that every field
    is a view of: one host-to-device copy per dtype per step, and ~6 fewer tensor constructions
    (each ~10-20 us, felt when a whole decode step of a small model takes ~2 ms)."""
    ids, positions, slots, cu, seq_lens, logits = [], [], [], [0], [], []
    for c in chunks:
        n = len(c.token_ids)
        end = c.num_computed + n
        if n == 0 or len(c.block_table) * block_size < end:
            raise ValueError(f"chunk needs >= 1 token and a block table covering {end} tokens")
        row0 = len(ids)
        for pos in range(c.num_computed, end):
            positions.append(pos)
            slots.append(c.block_table[pos // block_size] * block_size + pos % block_size)
        ids.extend(c.token_ids)
        cu.append(len(ids))
        seq_lens.append(end)
        if c.logits:
            logits.extend(range(row0, row0 + n) if c.all_logits else [row0 + n - 1])
    width = max(len(c.block_table) for c in chunks)
    tables = []
    for c in chunks:
        tables += c.block_table
        tables += [0] * (width - len(c.block_table))
    n, s = len(ids), len(chunks)
    wide = torch.tensor(ids + positions + slots + logits, dtype=torch.int64)
    narrow = torch.tensor(cu + seq_lens + tables, dtype=torch.int32)
    if torch.device(device).type != "cpu":
        wide, narrow = wide.to(device), narrow.to(device)
    return BatchInput(
        input_ids=wide[:n],
        positions=wide[n:2 * n],
        slot_mapping=wide[2 * n:3 * n],
        cu_seqlens_q=narrow[:s + 1],
        seq_lens=narrow[s + 1:2 * s + 1],
        block_tables=narrow[2 * s + 1:].view(s, width),
        logits_indices=wide[3 * n:],
        max_seqlen_q=max(len(c.token_ids) for c in chunks),
        max_seq_len=max(seq_lens),
    )


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
    def __init__(self, model_dir: str, args: EngineConfig, lora: LoRAConfig | None = None):
        """Load config + weights (any HF Llama/Mistral/Qwen2 directory), pick the attention backend,
        size and allocate the KV pool (``self.storage``: KVCacheStorage, ``self.num_blocks``);
        with ``lora.max_loras`` the LoRA registry (``self.loras``)."""
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        self.args = args
        self.device = torch.device(args.device)
        self.dtype = parse_dtype(args.dtype, self.device)
        self.config = cfg = load_model_config(model_dir)
        max_len = model_max_len(cfg, args)
        self.model = load_model(model_dir, cfg, dtype=self.dtype, device=self.device, max_positions=max_len,
                                quantization=args.quantization, quant_group_size=args.quant_group_size,
                                quant_lm_head=args.head_quantized)
        q = self.model.quantization
        logging.getLogger("triton_llm.model").info(
            "loaded %s: dtype %s, quantization %s%s, weights %.1f MiB", model_dir,
            str(self.dtype).removeprefix("torch."), q["method"],
            (f" (group {q['group_size']})" if q["group_size"] else "") + (", LM head too" if q.get("lm_head") else ""),
            q["weight_bytes"] / 2**20)
        self.attention = make_attention_backend(args.attention_backend, self.device)
        self.kv_dtype = kv_cache_torch_dtype(args)
        if self.kv_dtype != self.dtype and self.attention.name != "torch":
            raise ValueError(f"kv_cache_dtype={args.kv_cache_dtype} (a {str(self.kv_dtype).removeprefix('torch.')} "
                             f"KV cache under {str(self.dtype).removeprefix('torch.')} weights) needs the torch "
                             f"attention backend (CPU); the {self.attention.name} kernels store and read the "
                             "model's dtype")

        shape = dict(num_layers=cfg.num_layers, block_size=args.block_size, num_kv_heads=cfg.num_kv_heads,
                     head_dim=cfg.head_dim)
        self.num_blocks = num_kv_blocks(cfg, args)
        if self.num_blocks <= 0:
            raise ValueError(f"kv_cache_memory={args.kv_cache_memory} bytes holds no KV block of this model")
        self.storage = KVCacheStorage(num_blocks=self.num_blocks, dtype=self.kv_dtype, device=self.device, **shape)
        # The pool is allocated once, so the per-layer views stay valid for the runner's life.
        self.kv_caches = [(self.storage.k_cache(i), self.storage.v_cache(i)) for i in range(cfg.num_layers)]
        self.info = ModelInfo(model_type=cfg.model_type, vocab_size=cfg.vocab_size, num_layers=cfg.num_layers,
                              num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, max_model_len=max_len,
                              eos_token_ids=list(cfg.eos_token_ids))
        # All-decode steps of fp32 CPU models in one C call (backend/model/fused_decode.py); None:
        # every step takes the torch path.
        self.fused = make_fused_decoder(self.model, self.kv_caches, args.block_size, self.attention)
        self.pooling = PoolingConfig.from_model_dir(model_dir)     # embedding requests' pooling
        self.loras = make_lora_registry(cfg, lora or LoRAConfig(), self.dtype, self.device)   # None: LoRA off

    info: ModelInfo
    num_blocks: int

    def execute(self, batch: BatchInput) -> torch.Tensor:
        """Run the model on the batch, writing K/V into the pool; return fp32 logits [num_logits, vocab]."""
        # Adapter rows too: the fused step adds their products in C (kernels/csrc/lora_cpu.c).
        if self.fused is not None and self.fused.accepts(batch.input_ids.shape[0], batch.seq_lens.shape[0]):
            # One C call, no autograd-visible torch op: no inference_mode context (~15 us) needed.
            return self.fused.forward(batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables,
                                      batch.seq_lens, batch.logits_indices, batch.cu_seqlens_q, batch.lora)
        return self._execute_torch(batch)

    @torch.inference_mode()
    def execute_pooled(self, batch: BatchInput) -> tuple[torch.Tensor, torch.Tensor]:
        """A step with embedding requests: fp32 logits [num_logits, vocab] and the final-normed
        hidden states [num_hidden, hidden] fp32 of ``batch.hidden_indices``. Always the torch path
        (the fused C step returns logits only); such steps are prefill work anyway."""
        dev = self.device
        h = self.model.trunk(batch.input_ids.to(dev), batch.positions.to(dev), self._meta(batch), self.kv_caches,
                             self.attention, batch.lora)
        logits = self.model.head(h.index_select(0, batch.logits_indices.to(dev)))
        hidden = self.model.model.norm.forward(h.index_select(0, batch.hidden_indices.to(dev)))
        return logits, hidden.float()

    def _meta(self, batch: BatchInput) -> AttentionMetadata:
        dev = self.device
        cu = batch.cu_seqlens_q.to(dev)
        max_q = batch.max_seqlen_q or int((batch.cu_seqlens_q[1:] - batch.cu_seqlens_q[:-1]).max())
        return AttentionMetadata(slot_mapping=batch.slot_mapping.to(dev), block_tables=batch.block_tables.to(dev),
                                 cu_seqlens_q=cu, seq_lens=batch.seq_lens.to(dev), max_seqlen_q=max_q,
                                 max_seq_len=batch.max_seq_len)

    @torch.inference_mode()
    def _execute_torch(self, batch: BatchInput) -> torch.Tensor:
        dev = self.device
        return self.model(batch.input_ids.to(dev), batch.positions.to(dev), self._meta(batch), self.kv_caches,
                          self.attention, batch.logits_indices.to(dev), batch.lora)
