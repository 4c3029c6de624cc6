"""The torch reference (also the CPU engine path) against attention written from its definition."""
import pytest
import torch

from kernel_batches import make_batch, naive_attention
from kernels import paged_attention_ref, store_kv_cache_ref

CASES = {
    # name: (q_lens, seq_lens)
    "decodes_unequal": ([1, 1, 1, 1], [1, 17, 40, 33]),
    "decodes_equal": ([1, 1, 1], [21, 21, 21]),
    "fresh_prefill": ([23], [23]),
    "chunk_over_prefix_and_decodes": ([1, 45, 1, 7, 1], [30, 77, 5, 7, 64]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("group", [1, 4])
def test_paged_attention_ref_matches_definition(case, group):
    q_lens, seq_lens = CASES[case]
    b = make_batch(q_lens, seq_lens, group=group, head_dim=32, block_size=8)
    out = paged_attention_ref(**b.args(scale=0.3))
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), naive_attention(b, 0.3), atol=1e-5, rtol=1e-5)


def test_paged_attention_ref_bf16_and_out():
    b = make_batch([1, 9, 1], [12, 30, 3], head_dim=64, dtype=torch.bfloat16)
    out = torch.full_like(b.query, 7.0)
    res = paged_attention_ref(**b.args(scale=0.125, out=out))
    assert res is out and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), naive_attention(b, 0.125), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv_cache_ref_skips_negative_slots(slot_dtype):
    kv = torch.zeros(2, 2, 4, 4, 2, 8)
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([13, -1, 0, 6, -1], dtype=slot_dtype)
    store_kv_cache_ref(key=key, value=value, k_cache=kv[1, 0], v_cache=kv[1, 1], slot_mapping=slots)
    expect = torch.zeros_like(kv)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expect[1, 0, slot // 4, slot % 4] = key[i]
            expect[1, 1, slot // 4, slot % 4] = value[i]
    assert torch.equal(kv, expect)
