"""The torch backend's decode fast path and prefill/decode split equal kernels.reference."""
from __future__ import annotations

import random

import pytest
import torch

import backend.model.decode_attention as decode_mod
from backend.model.attention import AttentionMetadata, TorchAttention
from kernels import cpu as cpu_kernels
from kernels.reference import paged_attention_ref, store_kv_cache_ref

BS, NUM_BLOCKS = 4, 96


def make_case(q_lens: list[int], ctx_lens: list[int], hq: int, hkv: int, d: int = 16, seed: int = 0):
    """Random pool + a batch whose sequence i has ctx_lens[i] tokens, the last q_lens[i] new."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    free = rng.sample(range(NUM_BLOCKS), NUM_BLOCKS)
    width = max(-(-n // BS) for n in ctx_lens) + 1          # one spare column: padding
    tables, slots = [], []
    for q_len, n in zip(q_lens, ctx_lens):
        own = [free.pop() for _ in range(-(-n // BS))]
        tables.append(own + [rng.randrange(NUM_BLOCKS)] * (width - len(own)))   # junk padding
        slots += [own[p // BS] * BS + p % BS for p in range(n - q_len, n)]
    t = sum(q_lens)
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=torch.tensor(tables, dtype=torch.int32),
                             cu_seqlens_q=torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32),
                             seq_lens=torch.tensor(ctx_lens, dtype=torch.int32), max_seqlen_q=max(q_lens))
    cache = [torch.randn(NUM_BLOCKS, BS, hkv, d, generator=g) for _ in range(2)]
    qkv = [torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv)]
    return meta, cache, qkv


def reference(meta, cache, qkv, scale):
    k_cache, v_cache = (c.clone() for c in cache)
    store_kv_cache_ref(key=qkv[1], value=qkv[2], k_cache=k_cache, v_cache=v_cache, slot_mapping=meta.slot_mapping)
    return paged_attention_ref(query=qkv[0], k_cache=k_cache, v_cache=v_cache, block_tables=meta.block_tables,
                               cu_seqlens_q=meta.cu_seqlens_q, seq_lens=meta.seq_lens, scale=scale)


@pytest.mark.parametrize("q_lens, ctx_lens", [
    ([1] * 9, [1, 5, 4, 17, 8, 3, 30, 12, 2]),                       # decode only, mixed lengths
    ([1, 6, 1, 1, 3], [9, 6, 20, 1, 11]),                            # decodes around prefill chunks
    ([5, 2], [5, 14]),                                               # prefill only
])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (6, 2)])
@pytest.mark.parametrize("c_kernels, d", [(True, 16), (True, 48), (False, 16)], ids=["c-d16", "c-d48", "torch"])
def test_torch_backend_matches_reference(monkeypatch, q_lens, ctx_lens, hq, hkv, c_kernels, d):
    """d=48: the C kernel's vector path (D a multiple of 8); d=16 its plain loops."""
    if c_kernels and not cpu_kernels.supports(torch.float32, "cpu"):
        pytest.skip("no C compiler: the CPU kernels fall back to torch")
    monkeypatch.setattr(decode_mod, "CHUNK_BYTES", 2048)        # force many small chunks
    meta, cache, qkv = make_case(q_lens, ctx_lens, hq, hkv, d=d)
    scale = 0.25
    want = reference(meta, cache, qkv, scale)
    k_cache, v_cache = (c.clone() for c in cache)
    backend = TorchAttention(c_kernels=c_kernels)
    got = backend.forward(*qkv, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    again = backend.forward(*qkv, k_cache, v_cache, meta, scale)   # second layer: cached split
    torch.testing.assert_close(again, want, atol=1e-5, rtol=1e-5)


def test_decode_plan_chunks_longest_first(monkeypatch):
    monkeypatch.setattr(decode_mod, "CHUNK_BYTES", 1024)          # 16 token rows of 64 bytes
    plan = decode_mod.plan_decode([0, 1, 2, 3], [3, 9, 1, 5], torch.zeros(4, 3, dtype=torch.int32), 4, 64)
    assert plan.rows.tolist() == [1, 3, 0, 2]
    # 9 tokens -> 3 blocks (12 slots): 1 per chunk; 5 -> 2 blocks (8 slots): 2 per chunk; 1 -> rest
    assert plan.chunks == [(0, 1, 3), (1, 3, 2), (3, 4, 1)]
    assert plan.neg_mask[3].tolist()[:2] == [0.0, float("-inf")]


@pytest.mark.skipif(not cpu_kernels.supports(torch.bfloat16, "cpu"), reason="no C compiler")
def test_c_kernels_bf16_cache_and_skipped_slots():
    """bf16 pool (K/V read as bf16, math in fp32) and slot -1 rows, against the reference."""
    meta, cache, qkv = make_case([1, 1, 3, 1], [7, 19, 3, 1], 6, 2, d=32, seed=3)
    meta.slot_mapping[2] = -1                                   # one prefill token is not stored
    cache = [c.to(torch.bfloat16) for c in cache]
    qkv = [x.to(torch.bfloat16) for x in qkv]
    want = reference(meta, cache, qkv, 0.2)
    k_cache, v_cache = (c.clone() for c in cache)
    got = TorchAttention(c_kernels=True).forward(*qkv, k_cache, v_cache, meta, 0.2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    want_k = cache[0].clone()
    store_kv_cache_ref(key=qkv[1], value=qkv[2], k_cache=want_k, v_cache=cache[1].clone(),
                       slot_mapping=meta.slot_mapping)
    assert torch.equal(k_cache, want_k)
