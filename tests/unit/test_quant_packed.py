"""int8 groups of 32 on the layout packed at load (backend/quant/csrc/w8_packed.c) against the
dequantized reference: the int16-activation bound of test_quant_cpu.py, per output; the AVX2 build
(x86-64-v3) of the same layout too. Shapes are odd on purpose: N not a multiple of 16 (the zero
columns of the last block never reach y), M across the 6-row tiles and their remainders, one
all-zero activation row (exactly the bias)."""
import ctypes
import platform

import pytest
import torch

from backend.quant import cpu, layout
from backend.quant.linear import QuantLinear

pytestmark = pytest.mark.skipif(cpu.library() is None or cpu.library().w8_packed_bytes(16, 32) == 0,
                                reason="no C compiler or no AVX2 build: no packed layout")


def a16_bound(x: torch.Tensor, dq: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    q = min(32767, (2**31 - 1) // (127 * x.shape[1]))
    return dq.abs().sum(1)[None, :] * x.abs().amax(1, keepdim=True) / (2 * q) + 1e-5 * ref.abs().max()


def _case(m: int, n: int, k: int, seed: int):
    torch.manual_seed(seed)
    w, x, bias = torch.randn(n, k), torch.randn(m, k), torch.randn(n)
    x *= torch.logspace(-3, 3, m)[:, None]
    x[m // 2] = 0
    qw = layout.quantize_int8(w, 32)
    return x, bias, qw, layout.dequantize(qw)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 12, 13, 64, 200])
@pytest.mark.parametrize("n,k", [(1, 32), (15, 64), (16, 576), (17, 96), (33, 1536), (100, 576), (40, 9024)])
def test_packed_gemm_within_the_int16_bound(m, n, k):
    x, bias, qw, dq = _case(m, n, k, m * 1000 + n + k)
    packed = cpu.pack("int8", qw.qweight, qw.scales, 32, k)
    ref = torch.nn.functional.linear(x, dq, bias)
    y = cpu.gemm(x, "int8", qw.qweight, qw.scales, None, 32, k, bias, packed=packed)
    assert ((y - ref).abs() <= a16_bound(x, dq, ref)).all()
    assert torch.equal(y[m // 2], bias)
    y0 = cpu.gemm(x, "int8", qw.qweight, qw.scales, None, 32, k, None, packed=packed)
    assert torch.equal(y0[m // 2], torch.zeros(n))


def test_packed_threads_strides_and_switches():
    """1 and 2 threads bit-identical; strided rows; w8_set_a16_min_m(0) (weight-only numerics) and
    M below PACKED_MIN_M read the row-major copy the buffer points at (the same bits as without it)."""
    lib = cpu.library()
    x, bias, qw, dq = _case(37, 50, 576, 5)
    packed = cpu.pack("int8", qw.qweight, qw.scales, 32, 576)
    run = lambda xx, p: cpu.gemm(xx, "int8", qw.qweight, qw.scales, None, 32, 576, bias, packed=p)  # noqa: E731
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(x, packed)
        torch.set_num_threads(2)
        assert torch.equal(run(x, packed), one)
        wide = torch.zeros(37, 700)
        wide[:, 50:626] = x
        assert torch.equal(run(wide[:, 50:626], packed), one)
        assert torch.equal(run(x[:1], packed), run(x[:1], None))             # 1 row: the GEMV
        lib.w8_set_a16_min_m(0)
        f32a = cpu.gemm(x, "int8", qw.qweight, qw.scales, None, 32, 576, bias, kernel="f32a")
        assert torch.equal(run(x, packed), f32a)                             # weight-only loops
    finally:
        lib.w8_set_a16_min_m(cpu.A16_MIN_M)
        torch.set_num_threads(before)


@pytest.mark.parametrize("m", [1, 2, 5, 16])
@pytest.mark.parametrize("packed", [True, False])
def test_column_slices_give_w8_gemm_bits(m, packed):
    """w8_gemm_cols (a caller's pool hands out column slices, one thread each): every slice's
    outputs equal w8_gemm's bits, packed or row-major, at every row count."""
    lib = cpu.library()
    n, k = 100, 576
    x, bias, qw, _ = _case(m, n, k, 3 + m)
    buf = cpu.pack("int8", qw.qweight, qw.scales, 32, k) if packed else None
    w, g = (buf.data_ptr(), cpu.PACKED_G) if packed else (qw.qweight.data_ptr(), 32)
    whole = torch.empty(m, n)
    lib.w8_gemm(x.data_ptr(), m, k, k, w, qw.scales.data_ptr(), g, bias.data_ptr(), n, whole.data_ptr(), n, 2)
    y = torch.full((m, n), float("nan"))
    for n0, n1 in [(0, 16), (16, 48), (48, 96), (96, 200)]:
        lib.w8_gemm_cols(x.data_ptr(), m, k, k, w, qw.scales.data_ptr(), g, bias.data_ptr(), n, y.data_ptr(), n,
                         n0, n1)
    assert torch.equal(y, whole)


def test_quant_linear_packs_and_repacks():
    """QuantLinear packs int8 groups of 32 on first use and again after its weight is written (the
    loader fills parameters after construction); per channel, int4 and K % 32 != 0 stay unpacked."""
    torch.manual_seed(9)
    w, x = torch.randn(40, 64), torch.randn(8, 64)
    mod = QuantLinear.from_quant(layout.quantize_int8(w, 32), None)
    y = mod(x)
    assert mod.packed is not None and mod.c_weight() == (mod.packed.data_ptr(), cpu.PACKED_G)
    other = layout.quantize_int8(torch.randn(40, 64), 32)
    with torch.no_grad():
        mod.qweight.copy_(other.qweight)
        mod.scales.copy_(other.scales)
    ref = torch.nn.functional.linear(x, layout.dequantize(other))
    y2 = mod(x)
    assert not torch.equal(y, y2) and ((y2 - ref).abs() <= a16_bound(x, layout.dequantize(other), ref)).all()
    for qw in (layout.quantize_int8(w), layout.quantize_int4(w, 32), layout.quantize_int8(torch.randn(8, 48), 32)):
        m = QuantLinear.from_quant(qw, None)
        assert m.pack() is None and m.c_weight() == (m.qweight.data_ptr(), m.group_size)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 builds only")
def test_packed_on_an_avx2_build():
    """The same layout on the library built for x86-64-v3 (AVX2, no AVX-512: two ymm halves per block)."""
    from kernels.cpu import _build, load_library

    path = _build(cpu.SOURCE, ["-O3", "-march=x86-64-v3", "-fopenmp", "-shared", "-fPIC"], cpu.EXTRA)
    assert path is not None
    lib = load_library(path)
    P, I = ctypes.c_void_p, ctypes.c_int64
    lib.w8_gemm.argtypes = [P, I, I, I, P, P, I, P, I, P, I, ctypes.c_int]
    lib.w8_packed_bytes.argtypes, lib.w8_packed_bytes.restype = [I, I], I
    lib.w8_pack_g32.argtypes = [P, P, I, I, P]
    lib.w8_set_a16_min_m.argtypes = [I]
    lib.w8_set_a16_min_m(cpu.A16_MIN_M)
    for m, n, k in [(2, 17, 576), (7, 33, 64), (16, 16, 1536), (1, 9, 96)]:
        x, bias, qw, dq = _case(m, n, k, 11 * m + n)
        buf = torch.empty(lib.w8_packed_bytes(n, k), dtype=torch.uint8)
        lib.w8_pack_g32(qw.qweight.data_ptr(), qw.scales.data_ptr(), n, k, buf.data_ptr())
        y = torch.empty(m, n)
        lib.w8_gemm(x.data_ptr(), m, k, k, buf.data_ptr(), qw.scales.data_ptr(), cpu.PACKED_G, bias.data_ptr(), n,
                    y.data_ptr(), n, 2)
        ref = torch.nn.functional.linear(x, dq, bias)
        assert ((y - ref).abs() <= a16_bound(x, dq, ref)).all(), (m, n, k)
