"""LoRA shrink / expand Triton kernels (kernels/lora.py) against torch's index_select, two
matmuls and index_add (backend/lora/batch.py's CPU path), under the interpreter or on a GPU.

Tolerance, relative to max |reference|: 1e-5 (fp32 products, only the summation order differs).
"""
import pytest
import torch


@pytest.mark.parametrize("t,k,n,r,col0", [(1, 64, 48, 8, 0), (37, 100, 70, 16, 30), (200, 96, 130, 64, 5)])
def test_shrink_expand_match_torch(triton_device, t, k, n, r, col0):
    from kernels.lora import lora_expand, lora_shrink

    x, a, b = torch.randn(t, k), torch.randn(r, k) * 0.1, torch.randn(n, r) * 0.1
    y = torch.randn(t, col0 + n + 3)                    # the adapter's target is a column slice
    rows = torch.randperm(t)[: max(1, t // 2)].sort().values
    scale = 2.0
    ref = y.clone()
    ref[:, col0:col0 + n].index_add_(0, rows, torch.nn.functional.linear(
        torch.nn.functional.linear(x.index_select(0, rows), a), b) * scale)
    dev = triton_device
    yd, rd = y.to(dev), rows.to(dev)
    lora_expand(lora_shrink(x.to(dev), rd, a.to(dev)), b.to(dev), yd, rd, col0=col0, scale=scale)
    got = yd.cpu()
    tol = 1e-5 * float(ref.abs().max())
    assert torch.allclose(got, ref, rtol=0, atol=tol), float((got - ref).abs().max())
    untouched = torch.ones(t, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(got[untouched], y[untouched])    # rows of other adapters / the base: as they were
