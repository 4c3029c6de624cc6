"""Triton KV-cache write against the torch reference: whole pool compared, so stray writes show."""
import pytest
import torch

from kernels import store_kv_cache, store_kv_cache_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv_cache_matches_reference(triton_device, dtype, slot_dtype):
    num_tokens, kv_heads, head_dim, block_size, num_blocks = 37, 2, 64, 16, 6
    pool = torch.randn(2, 2, num_blocks, block_size, kv_heads, head_dim).to(dtype)
    # key/value as views of a fused QKV projection output: strided along tokens.
    qkv = torch.randn(num_tokens, 4 + 2 * kv_heads, head_dim).to(dtype)
    key, value = qkv[:, 4:4 + kv_heads], qkv[:, 4 + kv_heads:]
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[0, 5, 36]] = -1                        # padding tokens are skipped
    slots = slots.to(slot_dtype)

    expect = pool.clone()
    store_kv_cache_ref(key=key, value=value, k_cache=expect[1, 0], v_cache=expect[1, 1],
                       slot_mapping=slots)
    dev = triton_device
    got = pool.clone().to(dev)
    store_kv_cache(key=key.to(dev), value=value.to(dev), k_cache=got[1, 0], v_cache=got[1, 1],
                   slot_mapping=slots.to(dev))
    assert torch.equal(got.cpu(), expect)
    assert not torch.equal(expect, pool)


def test_store_kv_cache_all_skipped_and_empty(triton_device):
    pool = torch.zeros(1, 2, 2, 4, 1, 16, device=triton_device)
    key = torch.ones(3, 1, 16, device=triton_device)
    store_kv_cache(key=key, value=key, k_cache=pool[0, 0], v_cache=pool[0, 1],
                   slot_mapping=torch.full((3,), -1, dtype=torch.int32, device=triton_device))
    store_kv_cache(key=key[:0], value=key[:0], k_cache=pool[0, 0], v_cache=pool[0, 1],
                   slot_mapping=torch.empty(0, dtype=torch.int64, device=triton_device))
    assert not pool.any()
