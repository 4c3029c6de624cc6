"""The CPU weight-only GEMMs (backend/quant/csrc/quant_cpu.c) against dequantize-then-matmul.

Tolerance: 1e-5 of max |reference| (fp32 products; only the summation order differs from BLAS).
Shapes are odd on purpose: K not a multiple of 8, 32 or the group, N not a multiple of anything,
M = 1 (decode), 2..5, 8, 15, 29 (the 8 / 4 / 1..3-row tiles and their remainders), 300 (prefill:
dequantize + BLAS).
"""
import pytest
import torch

from backend.quant import cpu, layout
from backend.quant.linear import QuantLinear

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="no C compiler: torch fallback only")

SHAPES = [(1, 37, 100), (2, 37, 100), (3, 19, 77), (5, 64, 200), (8, 21, 100), (15, 40, 77), (16, 33, 576),
          (29, 33, 200), (300, 70, 200)]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("method,group", [("int8", None), ("int8", 32), ("int4", 32), ("int4", 64)])
def test_cpu_gemm_matches_dequantize_then_matmul(m, n, k, method, group):
    torch.manual_seed(m * 1000 + k)
    w, x, bias = torch.randn(n, k), torch.randn(m, k), torch.randn(n)
    qw = layout.quantize_int8(w, group) if method == "int8" else layout.quantize_int4(w, group)
    ref = torch.nn.functional.linear(x, layout.dequantize(qw), bias)
    y = cpu.gemm(x, method, qw.qweight, qw.scales, qw.zeros, qw.group_size, k, bias)
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.equal(cpu.dequantize(method, qw.qweight, qw.scales, qw.zeros, qw.group_size, k),
                       layout.dequantize(qw))


def test_cpu_gemm_strided_rows_and_threads():
    torch.manual_seed(1)
    w, big = torch.randn(40, 96), torch.randn(3, 200)
    x = big[:, 10:106]                                   # row stride 200, unit last stride
    qw = layout.quantize_int4(w, 32)
    ref = torch.nn.functional.linear(x, layout.dequantize(qw))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            y = cpu.gemm(x, "int4", qw.qweight, qw.scales, qw.zeros, 32, 96, None)
            assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    finally:
        torch.set_num_threads(before)


def test_quantization_error_is_bounded():
    """int8 per channel: |W - dq| <= scale / 2; int4: within half a grid step of each group."""
    torch.manual_seed(2)
    w = torch.randn(64, 100)
    q8 = layout.quantize_int8(w)
    assert ((layout.dequantize(q8) - w).abs() <= q8.scales.float() / 2 + 1e-6).all()
    q4 = layout.quantize_int4(w, 32)
    step = q4.scales.float().repeat_interleave(32, 1)[:, :100]
    assert ((layout.dequantize(q4) - w).abs() <= step / 2 + 2e-3 * w.abs().max()).all()
    assert layout.unpack_int4(layout.pack_int4(torch.arange(100).remainder(16).to(torch.uint8).repeat(3, 1)),
                              100).equal(torch.arange(100).remainder(16).to(torch.uint8).repeat(3, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_forward_on_cpu(dtype):
    torch.manual_seed(3)
    w, bias, x = torch.randn(24, 64), torch.randn(24), torch.randn(2, 3, 64)
    mod = QuantLinear.from_quant(layout.quantize_int4(w, 32), bias)
    ref = torch.nn.functional.linear(x, layout.dequantize(mod.quant_weight()), bias)
    y = mod.forward(x.to(dtype))
    assert y.dtype == dtype and y.shape == (2, 3, 24)
    assert (y.float() - ref).abs().max() <= (1e-5 if dtype == torch.float32 else 3e-2) * ref.abs().max()
