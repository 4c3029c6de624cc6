"""CPU weight-only GEMMs: ``csrc/*.c`` (one library; files in ``csrc/quant_cpu.h``) through ctypes,
built by kernels/cpu.py's cache.

Why C and not torch's packed kernels: on this torch (2.13, AVX2 host) ``torch._weight_int8pack_mm``
with fp32 activations runs ~10x slower than fp32 ``F.linear`` at M = 1 and 16, and
``torch._weight_int4pack_mm_for_cpu`` is slower still in fp32 and only matches fp32 in bf16
(numbers in docs/quantization.md, ``python -m load.bench_quant --kernels``).

int8 (``w8_gemm``, also what the fused decode step calls) quantizes each activation row to int16
(one scale per row, exact int32 products; activation rounding at most max|x[m]| / (2 Q) per
element, Q = min(32767, (2^31 - 1) / (127 K)); bound and measurements in docs/quantization.md):

- groups of 32 packed at load (:func:`pack`, QuantLinear.pack; AVX2 and AVX-512 builds):
  csrc/w8_packed.c from ``PACKED_MIN_M`` rows (16 output columns per vector, no horizontal sums:
  ~2.3x the row-major tiles from 4 rows, ``python -m bench.int8_gflops``), the row-major GEMV at 1.
- row-major groups of 32 (K a multiple of 32) on AVX-512BW hosts: csrc/w8_avx512.c at every M
  (1 row: a 4-stream GEMV). It beat dequantize + MKL and fp32 ``F.linear`` at every M measured
  (1-256 rows, ``python -m bench.int8_crossover``), so there is no BLAS crossover on those hosts.
- groups of 32 on AVX2 hosts: the 256-bit tiles of csrc/w8_a16.c at 1 row and from ``A16_MIN_M``
  rows, the weight-only loops at 2-4 rows; above ``SMALL_M`` rows the torch path dequantizes and
  runs BLAS (0.6-0.9x MKL there, measured on Zen 3).
- per output channel (``quant_group_size=0``): the GEMVs at 1-2 rows, the weight-only loops at 3-4,
  the int16 tiles from ``A16_MIN_M`` rows at every M.
- other groups and int4: the weight-only C loops up to ``SMALL_M`` rows, dequantize + BLAS above.

``w8_set_a16_min_m(0)`` (tests, benchmarks) gives the weight-only numerics (fp32 activations) at
every M. ``None`` from :func:`library` (no compiler, ``TRITON_LLM_CPU_KERNELS=0``) means the torch path
(dequantize + F.linear) for every call.
"""
from __future__ import annotations

import ctypes
import functools
import pathlib

import torch
import torch.nn.functional as F

from common import env

CSRC = pathlib.Path(__file__).with_name("csrc")
SOURCE = CSRC / "w8_gemm.c"                # + the rest of csrc/ in one library (csrc/quant_cpu.h)
EXTRA = tuple(CSRC / f for f in ("w8_f32a.c", "w8_a16.c", "w8_gemv.c", "w8_avx512.c", "w8_packed.c", "w8_quantize.c", "w4.c"))
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
SMALL_M = 32
PACKED_MIN_M = 2      # int8 groups of 32 packed at load (csrc/w8_packed.c): from this many rows
PACKED_G = -32        # w8_gemm's G for a packed buffer (csrc/quant_cpu.h W8_PACKED_G)
A16_MIN_M = 5         # int8: int16 activations from this many rows on, and at 1 (and, per channel, 2) rows (csrc: w8_gemm)
_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@functools.lru_cache(maxsize=1)
def library():
    if not env.flag("TRITON_LLM_CPU_KERNELS"):
        return None
    from kernels.cpu import _build, load_library

    path = _build(SOURCE, FLAGS, EXTRA)
    if path is None:
        return None
    lib = load_library(path)       # owner / mode checked (kernels/cpu.py)
    for fn in (lib.w8_gemm, lib.w8_gemm_f32a, lib.w8_gemm_a16):
        fn.argtypes = [_P, _I, _I, _I, _P, _P, _I, _P, _I, _P, _I, _C]
        fn.restype = None
    lib.w8_has_avx512.argtypes, lib.w8_has_avx512.restype = [], _C
    if lib.w8_has_avx512():
        lib.w8_gemm_g32_z.argtypes, lib.w8_gemm_g32_z.restype = [_P, _I, _I, _I, _P, _P, _P, _I, _P, _I, _C], None
    lib.w8_set_a16_min_m.argtypes, lib.w8_set_a16_min_m.restype = [_I], None
    lib.w8_a16_min_m.argtypes, lib.w8_a16_min_m.restype = [], _I
    lib.w8_set_a16_min_m(A16_MIN_M)
    lib.w8_set_packed_min_m.argtypes, lib.w8_set_packed_min_m.restype = [_I], None
    lib.w8_packed_min_m.argtypes, lib.w8_packed_min_m.restype = [], _I
    lib.w8_packed_bytes.argtypes, lib.w8_packed_bytes.restype = [_I, _I], _I
    lib.w8_pack_g32.argtypes, lib.w8_pack_g32.restype = [_P, _P, _I, _I, _P], None
    lib.w8_set_packed_min_m(PACKED_MIN_M)
    lib.w8_quantize.argtypes, lib.w8_quantize.restype = [_P, _I, _I, _I, _P, _P, _C], None
    lib.w8_gemm_cols.argtypes, lib.w8_gemm_cols.restype = [_P, _I, _I, _I, _P, _P, _I, _P, _I, _P, _I, _I, _I], None
    lib.w4_gemm.argtypes = [_P, _I, _I, _I, _P, _P, _P, _I, _P, _I, _P, _I, _C]
    lib.w8_dequant.argtypes = [_P, _P, _I, _I, _I, _P, _C]
    lib.w4_dequant.argtypes = [_P, _P, _P, _I, _I, _I, _P, _C]
    for fn in (lib.w8_gemm, lib.w4_gemm, lib.w8_dequant, lib.w4_dequant):
        fn.restype = None
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def pack(method: str, qweight: torch.Tensor, scales: torch.Tensor, group_size: int, k: int) -> torch.Tensor | None:
    """int8 in groups of 32 (K % 32 == 0) -> the packed buffer w8_gemm reads with G = PACKED_G
    (csrc/w8_packed.c: header, weights [N/16][K/2][16][2], fp32 scales); None where it does not apply
    (other methods or groups, no AVX2 build, no library). The buffer points at ``qweight`` and
    ``scales`` (the GEMVs read those at 1 row): keep them alive and unchanged with it."""
    lib = library()
    if (lib is None or method != "int8" or group_size != 32 or k % 32 or qweight.device.type != "cpu"
            or not qweight.is_contiguous() or not scales.is_contiguous()):
        return None
    nbytes = lib.w8_packed_bytes(qweight.shape[0], k)
    if nbytes <= 0:
        return None
    buf = torch.empty(nbytes, dtype=torch.uint8)
    lib.w8_pack_g32(qweight.data_ptr(), scales.data_ptr(), qweight.shape[0], k, buf.data_ptr())
    return buf


def quantize_int8(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """layout.quantize_int8's rule in C (csrc/w8_quantize.c): (q int8 [N, K], scales fp16 [N, NG]),
    or None without the library."""
    lib = library()
    if lib is None:
        return None
    n, k = w.shape
    w = w.float().contiguous()
    q = torch.empty(n, k, dtype=torch.int8)
    s = torch.empty(n, -(-k // group_size), dtype=torch.float16)
    lib.w8_quantize(w.data_ptr(), n, k, group_size, q.data_ptr(), s.data_ptr(), torch.get_num_threads())
    return q, s


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
         bias: torch.Tensor | None, kernel: str | None = None, packed: torch.Tensor | None = None) -> torch.Tensor:
    """x fp32 [M, K] (unit last stride) -> fp32 [M, N]. ``kernel`` (benchmarks, tests): ``blas``
    (dequantize + F.linear), ``f32a`` (int8 weight-only C loops), ``a16`` (int8 x int16
    activations), ``c`` (w8_gemm / w4_gemm, which pick by M); None: the routing below. ``packed``
    (:func:`pack` of these weights): w8_gemm on it (the packed tiles from PACKED_MIN_M rows)."""
    m, n = x.shape[0], qweight.shape[0]
    if packed is not None and kernel in (None, "c"):
        x = x if x.stride(1) == 1 else x.contiguous()
        y = torch.empty(m, n, dtype=torch.float32)
        library().w8_gemm(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), scales.data_ptr(), PACKED_G,
                          _ptr(bias), n, y.data_ptr(), n, torch.get_num_threads())
        return y
    if kernel is None:
        lib = library()
        a16 = method == "int8" and lib.w8_a16_min_m() > 0 and (
            group_size >= k or (group_size == 32 and k % 32 == 0 and lib.w8_has_avx512()))
        kernel = "c" if m <= SMALL_M or a16 else "blas"
    if kernel == "blas":
        return F.linear(x, dequantize(method, qweight, scales, zeros, group_size, k), bias)
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    nt = torch.get_num_threads()
    if method == "int8":
        if kernel == "z":           # groups of 32, 512-bit int16-activation tiles (AVX-512BW builds)
            library().w8_gemm_g32_z(x.data_ptr(), m, k, x.stride(0), qweight.data_ptr(), scales.data_ptr(),
                                    _ptr(bias), n, y.data_ptr(), n, nt)
            return y
        fn = {"c": library().w8_gemm, "f32a": library().w8_gemm_f32a, "a16": library().w8_gemm_a16}[kernel]
        fn(x.data_ptr(), m, k, x.stride(0), qweight.data_ptr(), scales.data_ptr(), group_size, _ptr(bias), n,
           y.data_ptr(), n, nt)
    else:
        library().w4_gemm(x.data_ptr(), m, k, x.stride(0), qweight.data_ptr(), scales.data_ptr(),
                          zeros.data_ptr(), group_size, _ptr(bias), n, y.data_ptr(), n, nt)
    return y
