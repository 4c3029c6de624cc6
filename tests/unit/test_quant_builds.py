"""The quant C library built for other CPUs than this one (backend/quant/csrc/): every file must
build and load with AVX2 only (x86-64-v3: the AVX-512 group kernel absent, its entry point routing
to the 256-bit kernels) and with no AVX at all (x86-64: the portable loops), and give the
dequantized weights' results there: within the int16-activation bound where int16 activations
are taken, within 1e-5 of max |ref| for the weight-only loops."""
import ctypes
import platform

import pytest
import torch

from backend.quant import cpu, layout
from kernels.cpu import _build, load_library

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or cpu.library() is None,
                                reason="x86-64 builds with a C compiler only")
_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _lib(march: str):
    path = _build(cpu.SOURCE, ["-O3", f"-march={march}", "-fopenmp", "-shared", "-fPIC"], cpu.EXTRA)
    assert path is not None, f"-march={march} did not build"
    lib = load_library(path)
    lib.w8_gemm.argtypes = [_P, _I, _I, _I, _P, _P, _I, _P, _I, _P, _I, _C]
    lib.w4_gemm.argtypes = [_P, _I, _I, _I, _P, _P, _P, _I, _P, _I, _P, _I, _C]
    lib.w8_has_avx512.restype = _C
    lib.w8_set_a16_min_m.argtypes = [_I]
    return lib


@pytest.mark.parametrize("march,int16", [("x86-64-v3", True), ("x86-64", False)])
def test_portable_builds_match_the_reference(march, int16):
    lib = _lib(march)
    assert lib.w8_has_avx512() == 0
    lib.w8_set_a16_min_m(cpu.A16_MIN_M)
    torch.manual_seed(3)
    for m, n, k, group in [(1, 37, 576, 32), (16, 37, 576, 32), (3, 19, 576, 32), (16, 21, 200, None)]:
        x, w, bias = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
        for method in ("int8", "int4"):
            qw = layout.quantize_int8(w, group) if method == "int8" else layout.quantize_int4(w, 32)
            dq = layout.dequantize(qw)
            ref = torch.nn.functional.linear(x, dq, bias)
            y = torch.empty(m, n)
            if method == "int8":
                lib.w8_gemm(x.data_ptr(), m, k, k, qw.qweight.data_ptr(), qw.scales.data_ptr(), qw.group_size,
                            bias.data_ptr(), n, y.data_ptr(), n, 1)
            else:
                lib.w4_gemm(x.data_ptr(), m, k, k, qw.qweight.data_ptr(), qw.scales.data_ptr(),
                            qw.zeros.data_ptr(), 32, bias.data_ptr(), n, y.data_ptr(), n, 1)
            a16 = int16 and method == "int8" and (m == 1 or m >= cpu.A16_MIN_M)
            q = min(32767, (2**31 - 1) // (127 * k))
            tol = dq.abs().sum(1)[None, :] * x.abs().amax(1, keepdim=True) / (2 * q) if a16 else 0.0
            assert ((y - ref).abs() <= tol + 1e-5 * ref.abs().max()).all(), (march, method, m, k, group)


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_portable_builds_quantize_like_the_reference(march):
    """csrc/w8_quantize.c's scale search on the other builds (the 8-lane group loop on AVX2, the
    portable fp16 rounding without F16C): the torch reference's scales and bytes."""
    lib = _lib(march)
    lib.w8_quantize.argtypes = [_P, _I, _I, _I, _P, _P, _C]
    torch.manual_seed(4)
    for n, k, group in [(40, 576, 32), (9, 100, 32), (5, 77, 77)]:
        w = torch.randn(n, k) * torch.logspace(-6, 1, n)[:, None]     # tiny rows: fp16 subnormal scales
        w[0, :32] = 0
        ref = layout.quantize_int8(w, group, reference=True)
        q, s = torch.empty(n, k, dtype=torch.int8), torch.empty_like(ref.scales)
        lib.w8_quantize(w.data_ptr(), n, k, group, q.data_ptr(), s.data_ptr(), 1)
        assert s.equal(ref.scales) and q.equal(ref.qweight), (march, n, k, group)
