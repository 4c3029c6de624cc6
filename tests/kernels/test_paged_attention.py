"""Triton paged attention against the torch reference (interpreter on CPU, or natively on CUDA)."""
import pytest
import torch

from kernel_batches import make_batch
from kernels import paged_attention, paged_attention_ref

# A long prefill chunk over a cached prefix, a fresh prompt, and decodes whose contexts are not
# multiples of the block size (one of them exactly one token long).
MIXED = ([1, 70, 1, 13, 1, 1], [37, 110, 16, 13, 1, 50])


def reference(b, scale):
    """The reference in fp32, so bf16 kernel results are judged against exact-ish values."""
    args = b.args(scale=scale)
    for name in ("query", "k_cache", "v_cache"):
        args[name] = args[name].float()
    return paged_attention_ref(**args)


def check(out, ref, dtype):
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float().cpu(), ref.cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_batch(triton_device, dtype, group, head_dim):
    b = make_batch(*MIXED, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype,
                   device=triton_device)
    scale = head_dim ** -0.5
    check(paged_attention(**b.args(scale=scale)), reference(b, scale), dtype)


@pytest.mark.parametrize("block_size", [8, 5])
def test_other_block_sizes(triton_device, block_size):
    b = make_batch(*MIXED, num_kv_heads=1, group=4, head_dim=64, block_size=block_size,
                   device=triton_device)
    check(paged_attention(**b.args(scale=0.125)), reference(b, 0.125), torch.float32)


@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("q_lens,seq_lens", [([1, 1, 1], [300, 129, 7]), MIXED], ids=["decode", "mixed"])
def test_split_kv_equals_single_pass(triton_device, splits, q_lens, seq_lens):
    b = make_batch(q_lens, seq_lens, num_kv_heads=2, group=4, head_dim=64, device=triton_device)
    single = paged_attention(**b.args(scale=0.125, num_kv_splits=1))
    split = paged_attention(**b.args(scale=0.125, num_kv_splits=splits))
    torch.testing.assert_close(split, single, atol=1e-5, rtol=1e-5)
    check(split, reference(b, 0.125), torch.float32)


def test_split_kv_bf16(triton_device):
    b = make_batch([1, 1], [260, 90], num_kv_heads=1, group=8, head_dim=128, dtype=torch.bfloat16,
                   device=triton_device)
    check(paged_attention(**b.args(scale=0.1, num_kv_splits=4)), reference(b, 0.1), torch.bfloat16)


def test_strided_query_and_preallocated_out(triton_device):
    """q as a view of a fused QKV output, out as a view of a larger buffer, int64 metadata."""
    b = make_batch(*MIXED, num_kv_heads=2, group=2, head_dim=64, device=triton_device)
    t, hq, d = b.query.shape
    qkv = torch.randn(t, hq + 4, d, device=triton_device)
    qkv[:, :hq] = b.query
    buf = torch.full((t, hq, 2 * d), 5.0, device=triton_device)
    out = buf[:, :, :d]
    args = b.args(scale=0.125, out=out)
    args.update(query=qkv[:, :hq], block_tables=b.block_tables.long(),
                cu_seqlens_q=b.cu_seqlens_q.long(), seq_lens=b.seq_lens.long())
    assert paged_attention(**args) is out
    check(out, reference(b, 0.125), torch.float32)
    assert torch.all(buf[:, :, d:] == 5.0)


def test_auto_split_and_empty_batch(triton_device):
    b = make_batch([1, 1], [200, 3], device=triton_device)
    check(paged_attention(**b.args(scale=0.125)), reference(b, 0.125), torch.float32)
    empty = make_batch([0], [4], device=triton_device)
    assert paged_attention(**empty.args(scale=0.125)).shape == (0, 8, 64)
