"""Where MKL's bf16 GEMM beats the fused step's own bf16 kernels: the crossover M, measured per host.

Why: a bf16 linear of the fused step (kernels/csrc/linear_bf16.c) runs this library's register
tiles (VDPBF16PS or AVX2) below 6 rows and, with AMX, AMX tiles above; MKL's
``cblas_gemm_bf16bf16f32`` (exported by torch's ``libtorch_cpu.so``, as ``sgemm_`` is) runs AMX
where the CPU has it and AVX512-BF16 / AVX2 code elsewhere, with its own blocking and packing,
which wins once a step is compute-bound (prefill chunks, many streams) on some CPUs and never on
others (on a loaded Zen 4 EPYC without AMX it lost to the VDPBF16PS tiles up to M = 128). So the
crossover is measured, not assumed. MKL runs single-threaded per call (``MKL_Set_Num_Threads_Local``)
on slices of 256 weight rows that the step's worker pool hands out (the same calls at any thread
count: the bits do not depend on it), because MKL's own OpenMP team would end every
call in a barrier waiting for a core the serving processes hold (on the loaded 2-core host: ~30 ms a
call at 2 threads against ~0.1 ms at 1).

How: at :class:`~backend.model.fused_decode.FusedDecoder` build, for a bf16 model, one layer's
four projections (qkv, o, gate_up, down: the shapes every layer repeats) are timed at M = 1, 2,
4, ... 256 rows through both paths on random inputs, each the best of :data:`REPS` calls after an
untimed one (MKL's stop early once it cannot win); the crossover is the first M from which MKL
takes at most :data:`MARGIN` of the own kernels' time at two sizes in a row; none:
:data:`NEVER`. Cached per process by shapes, threads and kernel set (a second model of the same
shapes, or a restart of the decoder, measures nothing). It costs ~0.1-1 s once per process for a
135M-parameter model. Both paths compute bf16(x) W^T in fp32 (the exactness contract,
docs/kernels.md), so the choice changes speed, not the contract.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import pathlib
import time

import torch

log = logging.getLogger("triton_llm.model")
NEVER = 1 << 62
CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
REPS = 3
MARGIN = 0.9
_cache: dict[tuple, int] = {}


@functools.lru_cache(maxsize=1)
def mkl_symbols() -> tuple[int, int] | None:
    """Addresses of MKL's ``cblas_gemm_bf16bf16f32`` and ``MKL_Set_Num_Threads_Local`` (the C entry;
    the lower-case name takes a pointer, Fortran style) in torch's CPU library, or None where they
    are not exported (``nm -D --defined-only libtorch_cpu.so``)."""
    try:
        lib = ctypes.CDLL(str(pathlib.Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        return (ctypes.cast(lib.cblas_gemm_bf16bf16f32, ctypes.c_void_p).value,
                ctypes.cast(lib.MKL_Set_Num_Threads_Local, ctypes.c_void_p).value)
    except (OSError, AttributeError):
        return None


def _best(fn, give_up: float = float("inf")) -> float:
    """Best of REPS timed calls after an untimed one; stops at a call slower than ``give_up``."""
    fn()
    best = float("inf")
    for _ in range(REPS):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        if best > give_up:
            break
    return best


def crossover(lib, cfg, shapes: list[tuple[int, int]], nt: int, avx2: bool) -> int:
    """The first M at which MKL's bf16 GEMM runs the linears of ``shapes`` ([(N, K)], one layer's
    projections) faster than the library's own kernels (``avx2``: its AVX2 kernels), on ``nt``
    threads; :data:`NEVER` if at no M tried. ``cfg``: the step's ctypes ``Model`` with its BLAS
    fields set (sgemm, bgemm, mkl_threads_local); its ``bgemm_min_m`` is left as it was."""
    key = (tuple(shapes), nt, avx2, bool(lib.amx_supported()), bool(cfg.sgemm), cfg.gemm_min_m)
    if key not in _cache:
        t, saved = time.perf_counter(), cfg.bgemm_min_m
        try:
            _cache[key] = _measure(lib, cfg, shapes, nt, avx2)
        finally:
            cfg.bgemm_min_m = saved
        log.info("bf16 GEMM crossover (MKL from M rows): %s (measured in %.2f s)",
                 "never" if _cache[key] == NEVER else _cache[key], time.perf_counter() - t)
    return _cache[key]


def _measure(lib, cfg, shapes, nt, avx2) -> int:
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=g) * k ** -0.5).bfloat16() for n, k in shapes]
    packed = [torch.empty(lib.bf16_packed_elems(n, k), dtype=torch.int16) for n, k in shapes]
    for (n, k), w, p in zip(shapes, weights, packed):   # the step's own kernels run on packed copies
        lib.bf16_pack(w.data_ptr(), n, k, p.data_ptr())
    wins = []
    for m in CANDIDATES:
        xs = [torch.randn(m, k, generator=g) for _, k in shapes]
        ys = [torch.empty(m, n) for n, _ in shapes]

        def run(min_m):
            cfg.bgemm_min_m = min_m
            for (n, k), w, p, x, y in zip(shapes, weights, packed, xs, ys):
                lib.linear_bf16_with(ctypes.byref(cfg), x.data_ptr(), m, k, w.data_ptr(),
                                     None if p is None else p.data_ptr(), None, n, y.data_ptr(),
                                     0, nt, int(avx2))
        own = _best(lambda: run(NEVER))
        wins.append(_best(lambda: run(1), give_up=own / MARGIN) <= MARGIN * own)
        if len(wins) >= 2 and wins[-1] and wins[-2]:
            return CANDIDATES[len(wins) - 2]
    return NEVER
