"""Attention backends: write this step's K/V into the paged pool, then attend through block tables.

Both backends call the keyword-only functions of ``kernels/`` (shapes in ``kernels/reference.py``)::

    TorchAttention   kernels.reference.store_kv_cache_ref + paged_attention_ref   (CPU default;
                     decodes take kernels/cpu.py's C kernel, which reads K/V through the block
                     table, or without a C compiler backend/model/decode_attention.py)
    TritonAttention  kernels.store_kv_cache + kernels.paged_attention              (CUDA, or CPU
                                                                                    under TRITON_INTERPRET=1)

The model calls ``backend.forward`` once per layer with that layer's cache views; everything
that is the same for all layers lives in :class:`AttentionMetadata`, built once per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backend.model.decode_attention import DecodePlan, decode_attention, plan_decode


@dataclass
class AttentionMetadata:
    """Per-step attention inputs shared by every layer (see BatchInput for the meaning)."""
    slot_mapping: torch.Tensor    # [num_tokens] int64, -1 = do not store
    block_tables: torch.Tensor    # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor    # [num_seqs + 1] int32
    seq_lens: torch.Tensor        # [num_seqs] int32, context incl. this step's tokens
    max_seqlen_q: int = 0         # host ints: let kernels size their grids without a device sync
    max_seq_len: int = 0
    # Backend-private per-step data computed on the first layer and reused by the others.
    cache: dict = field(default_factory=dict, repr=False)


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


@dataclass
class _TorchSplit:
    """How a step divides between the decode fast path and the reference (prefill chunks)."""
    decode: DecodePlan | None
    c_decode: tuple | None                # (rows, seq, ctx) for kernels.cpu.attend, instead of `decode`
    prefill_rows: torch.Tensor | None     # query rows of the prefill sequences; None: every row
    prefill_args: dict | None             # block_tables / cu_seqlens_q / seq_lens of those sequences


class TorchAttention(AttentionBackend):
    """CPU path. Decodes (q_len 1) go through :func:`decode_attention`; prefill chunks through
    ``kernels.reference.paged_attention_ref`` (which gathers the chunk's blocks and runs SDPA)."""
    name = "torch"

    def __init__(self, c_kernels: bool = True):
        from kernels.reference import paged_attention_ref, store_kv_cache_ref
        self._store, self._attend = store_kv_cache_ref, paged_attention_ref
        self._c_kernels = c_kernels

    def forward(self, query, key, value, k_cache, v_cache, meta, scale):
        from kernels import cpu

        use_c = self._c_kernels and cpu.supports(k_cache.dtype, k_cache.device)
        if use_c:           # a half cache under fp32 weights (kv_cache_dtype): converted (RNE) as stored
            cpu.store_kv(key.to(k_cache.dtype).contiguous(), value.to(v_cache.dtype).contiguous(), k_cache,
                         v_cache, meta.slot_mapping)
        else:
            self._store(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=meta.slot_mapping)
        split = meta.cache.get("torch_split")
        if split is None:
            split = meta.cache["torch_split"] = self._split(meta, k_cache.shape[1],
                                                            query.shape[1] * query.shape[2] * 4,  # fp32 math
                                                            query.device, use_c)
        if split.c_decode is not None:
            rows, seq, ctx = split.c_decode
            q32 = query.float().contiguous()
            out = torch.empty_like(q32)
            cpu.attend(q32, k_cache, v_cache, meta.cache["c_tables"], rows, seq, ctx, scale, out)
            out = out.to(query.dtype)
        else:
            out = torch.empty_like(query)
        if split.decode is not None:
            decode_attention(query, k_cache, v_cache, split.decode, scale, out)
        if split.prefill_args is not None:
            q = query if split.prefill_rows is None else query.index_select(0, split.prefill_rows)
            o = self._attend(query=q, k_cache=k_cache, v_cache=v_cache, scale=scale, **split.prefill_args)
            if split.prefill_rows is None:
                return o
            out.index_copy_(0, split.prefill_rows, o)
        return out

    @staticmethod
    def _split(meta: AttentionMetadata, block_size: int, row_bytes: int, device, use_c: bool) -> _TorchSplit:
        starts, lens = meta.cu_seqlens_q.tolist(), meta.seq_lens.tolist()
        q_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]
        dec = [i for i, n in enumerate(q_lens) if n == 1]
        pre = [i for i, n in enumerate(q_lens) if n > 1]
        plan = c_plan = None
        if dec and use_c:
            meta.cache["c_tables"] = meta.block_tables.to(torch.int32).contiguous()
            c_plan = (torch.tensor([starts[i] for i in dec], dtype=torch.int64),
                      torch.tensor(dec, dtype=torch.int32), torch.tensor([lens[i] for i in dec], dtype=torch.int32))
        elif dec:
            tables = meta.block_tables if len(dec) == len(lens) else meta.block_tables[dec]
            plan = plan_decode([starts[i] for i in dec], [lens[i] for i in dec], tables, block_size,
                               row_bytes, device)
        if not pre:
            return _TorchSplit(plan, c_plan, None, None)
        if not dec:
            return _TorchSplit(None, None, None, dict(block_tables=meta.block_tables,
                                                      cu_seqlens_q=meta.cu_seqlens_q, seq_lens=meta.seq_lens))
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in pre]).to(device)
        cu = torch.tensor([0] + [q_lens[i] for i in pre]).cumsum(0).to(device=device, dtype=torch.int32)
        args = dict(block_tables=meta.block_tables[pre], cu_seqlens_q=cu,
                    seq_lens=meta.seq_lens[pre])
        return _TorchSplit(plan, c_plan, rows, args)


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
