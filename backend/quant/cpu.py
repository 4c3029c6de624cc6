"""CPU weight-only GEMMs: ``csrc/quant_cpu.c`` through ctypes, built by kernels/cpu.py's cache.

Why C and not torch's packed kernels: on this torch (2.13, AVX2 host) ``torch._weight_int8pack_mm``
with fp32 activations runs ~10x slower than fp32 ``F.linear`` at M = 1 and 16, and
``torch._weight_int4pack_mm_for_cpu`` is slower still in fp32 and only matches fp32 in bf16
(numbers in docs/quantization.md, ``python -m load.bench_quant --kernels``).

Decode-sized calls (M <= ``SMALL_M``) run the C kernel, bound by weight bytes. Larger calls
(prefill chunks) dequantize the weight into an fp32 scratch once and call BLAS: there the GEMM is
compute-bound and the N*K dequantization is small next to M*N*K multiply-adds.
``None`` from :func:`library` (no compiler, ``TRITON_LLM_CPU_KERNELS=0``) means the torch path
(dequantize + F.linear) for every call.
"""
from __future__ import annotations

import ctypes
import functools
import os
import pathlib

import torch
import torch.nn.functional as F

SOURCE = pathlib.Path(__file__).with_name("csrc") / "quant_cpu.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
SMALL_M = 32
_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@functools.lru_cache(maxsize=1)
def library():
    if os.environ.get("TRITON_LLM_CPU_KERNELS", "1").lower() in ("0", "false", "off", "no"):
        return None
    from kernels.cpu import _build

    path = _build(SOURCE, FLAGS)
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    lib.w8_gemm.argtypes = [_P, _I, _I, _I, _P, _P, _I, _P, _I, _P, _I, _C]
    lib.w4_gemm.argtypes = [_P, _I, _I, _I, _P, _P, _P, _I, _P, _I, _P, _I, _C]
    lib.w8_dequant.argtypes = [_P, _P, _I, _I, _I, _P, _C]
    lib.w4_dequant.argtypes = [_P, _P, _P, _I, _I, _I, _P, _C]
    for fn in (lib.w8_gemm, lib.w4_gemm, lib.w8_dequant, lib.w4_dequant):
        fn.restype = None
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def dequantize(method: str, qweight, scales, zeros, group_size: int, k: int) -> torch.Tensor:
    """fp32 [N, K] with the C loops (multi-threaded)."""
    n = qweight.shape[0]
    out = torch.empty(n, k, dtype=torch.float32)
    nt = torch.get_num_threads()
    if method == "int8":
        library().w8_dequant(qweight.data_ptr(), scales.data_ptr(), group_size, n, k, out.data_ptr(), nt)
    else:
        library().w4_dequant(qweight.data_ptr(), scales.data_ptr(), zeros.data_ptr(), group_size, n, k,
                             out.data_ptr(), nt)
    return out


def gemm(x: torch.Tensor, method: str, qweight, scales, zeros, group_size: int, k: int,
         bias: torch.Tensor | None) -> torch.Tensor:
    """x fp32 [M, K] (unit last stride) -> fp32 [M, N]."""
    m, n = x.shape[0], qweight.shape[0]
    if m > SMALL_M:
        return F.linear(x, dequantize(method, qweight, scales, zeros, group_size, k), bias)
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    nt = torch.get_num_threads()
    if method == "int8":
        library().w8_gemm(x.data_ptr(), m, k, x.stride(0), qweight.data_ptr(), scales.data_ptr(),
                          group_size, _ptr(bias), n, y.data_ptr(), n, nt)
    else:
        library().w4_gemm(x.data_ptr(), m, k, x.stride(0), qweight.data_ptr(), scales.data_ptr(),
                          zeros.data_ptr(), group_size, _ptr(bias), n, y.data_ptr(), n, nt)
    return y
