"""Fused RMSNorm and RoPE kernels against their references; references against the model's formulas."""
import pytest
import torch

from kernels import rms_norm, rms_norm_ref, rope, rope_ref

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@DTYPES
def test_rms_norm(triton_device, dtype):
    x = torch.randn(37, 96, 200).to(dtype)[:, 3, :]              # strided rows, hidden not a power of 2
    w, res = torch.randn(200).to(dtype), torch.randn(37, 200).to(dtype)
    dev = triton_device
    got = rms_norm(x=x.to(dev), weight=w.to(dev), eps=1e-5)
    torch.testing.assert_close(got.cpu(), rms_norm_ref(x=x, weight=w, eps=1e-5), **tol(dtype))
    normed, summed = rms_norm(x=x.to(dev), weight=w.to(dev), eps=1e-5, residual=res.to(dev))
    ref_normed, ref_summed = rms_norm_ref(x=x, weight=w, eps=1e-5, residual=res)
    assert torch.equal(summed.cpu(), ref_summed)
    torch.testing.assert_close(normed.cpu(), ref_normed, **tol(dtype))


def test_rms_norm_ref_is_llama_rmsnorm():
    x, w = torch.randn(5, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    xf = x.float()
    expect = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    assert torch.equal(rms_norm_ref(x=x, weight=w, eps=1e-6), expect)


@DTYPES
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_rope_in_place(triton_device, dtype, heads):
    hq, hkv, d, t = *heads, 64, 29
    qkv = torch.randn(t, hq + 2 * hkv, d).to(dtype)             # q and k as views of a fused output
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(512).float(), inv)
    cos, sin = freqs.cos(), freqs.sin()
    positions = torch.randint(0, 512, (t,))
    expect = qkv.clone()
    rope_ref(query=expect[:, :hq], key=expect[:, hq:hq + hkv], cos=cos, sin=sin, positions=positions)
    dev = triton_device
    got = qkv.clone().to(dev)
    rope(query=got[:, :hq], key=got[:, hq:hq + hkv], cos=cos.to(dev), sin=sin.to(dev),
         positions=positions.to(dev))
    torch.testing.assert_close(got.cpu(), expect, **tol(dtype))
    assert torch.equal(got[:, hq + hkv:].cpu(), qkv[:, hq + hkv:])   # v untouched
    # The reference is the model's rotate-halves formula.
    x1, x2 = qkv[:, :hq].float().chunk(2, -1)
    c, s = cos[positions][:, None], sin[positions][:, None]
    torch.testing.assert_close(expect[:, :hq].float(), torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1),
                               **tol(dtype))
