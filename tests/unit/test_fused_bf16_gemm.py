"""The fused step's bf16 linears through MKL's ``cblas_gemm_bf16bf16f32`` (backend/model/bf16_gemm.py):
the same contract as the library's own bf16 kernels (bf16-rounded inputs, fp32 accumulation),
forced at every M; the crossover measured once per process and restoring the step's struct; a
decoder taking the measured crossover or the caller's. Whole-model exactness on both paths against
transformers in bf16: tests/unit/test_model_dtype.py ("mkl", "own")."""
from __future__ import annotations

import ctypes

import pytest
import torch

from backend.model import bf16_gemm
from backend.model.fused_decode import FusedDecoder, _Model
from kernels import cpu
from tests.conftest import model_dir
from tests.unit.test_model_parity import BLOCK, make_runner


@pytest.fixture(scope="module")
def lib():
    lib = cpu.decode_library()
    if lib is None or not lib.bf16_supported():
        pytest.skip("no C compiler, or no bf16 kernel set on this CPU")
    if bf16_gemm.mkl_symbols() is None:
        pytest.skip("torch's CPU library exports no MKL bf16 GEMM")
    return lib


def cfg(min_m: int) -> _Model:
    bgemm, local = bf16_gemm.mkl_symbols()
    return _Model(bgemm=bgemm, mkl_threads_local=local, bgemm_min_m=min_m, gemm_min_m=bf16_gemm.NEVER)


def linear(lib, c, x, w, bias, y0, acc: int, nt: int, avx2: int = 0) -> torch.Tensor:
    y = y0.clone()
    m, k = x.shape
    assert lib.linear_bf16_with(ctypes.byref(c) if c is not None else None, x.data_ptr(), m, k, w.data_ptr(),
                                None, None if bias is None else bias.data_ptr(), w.shape[0], y.data_ptr(), acc, nt,
                                avx2) == 0
    return y


# N past one 256-row MKL slice (and its tail), K tails, sizes big enough for 2 threads
@pytest.mark.parametrize("n,k", [(1, 16), (37, 100), (300, 64), (600, 256), (1030, 72)])
def test_mkl_linear_against_float64(lib, n, k):
    """bf16(x) W^T (+ bias, + the residual) through MKL, forced at every M, against float64 over the
    same bf16 values, on 1 and 2 threads; the own kernels agree. Not bit-identical across thread
    counts: MKL's single-threaded calls on the pool's threads differed by an ulp now and then (CI)."""
    g = torch.Generator().manual_seed(n * 100 + k)
    w, b = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g)
    mkl = cfg(1)
    for m in (1, 3, 16, 33, 70):
        x, y0 = torch.randn(m, k, generator=g), torch.randn(m, n, generator=g)
        for bias, acc in ((None, 0), (b, 0), (b, 1)):
            want = (x.bfloat16().double() @ w.double().T + (0 if bias is None else bias.double())
                    + (y0.double() if acc else 0))
            tol = 1e-5 * max(1.0, want.abs().max().item())
            for nt in (1, 2):
                got = linear(lib, mkl, x, w, bias, y0, acc, nt)
                assert (got.double() - want).abs().max().item() <= tol, (m, acc, nt, (got.double() - want).abs().max())
            own = linear(lib, None, x, w, bias, y0, acc, 1)
            assert (own.double() - want).abs().max().item() <= tol, (m, acc, (own.double() - want).abs().max())


def test_the_threshold_routes_by_rows(lib):
    """Below bgemm_min_m the library's own kernels run (bit-identical to no MKL at all), from it MKL."""
    g = torch.Generator().manual_seed(5)
    w, x, y0 = torch.randn(300, 96, generator=g).bfloat16(), torch.randn(8, 96, generator=g), torch.zeros(8, 300)
    own = linear(lib, None, x, w, None, y0, 0, 1)
    assert torch.equal(linear(lib, cfg(9), x, w, None, y0, 0, 1), own)
    assert torch.equal(linear(lib, cfg(8), x, w, None, y0, 0, 1), linear(lib, cfg(1), x, w, None, y0, 0, 1))


def test_crossover_is_measured_once_and_leaves_the_struct(lib, monkeypatch):
    shapes = [(96, 64), (64, 64), (256, 64), (64, 128)]
    c = cfg(123)
    monkeypatch.setattr(bf16_gemm, "_cache", {})
    got = bf16_gemm.crossover(lib, c, shapes, 1, False)
    assert got == bf16_gemm.NEVER or got in bf16_gemm.CANDIDATES
    assert c.bgemm_min_m == 123

    def boom(*a):
        raise AssertionError("measured twice")
    monkeypatch.setattr(bf16_gemm, "_measure", boom)
    assert bf16_gemm.crossover(lib, c, shapes, 1, False) == got           # cached per process


def test_crossover_picks_the_first_of_two_wins_in_a_row(lib, monkeypatch):
    """_measure's rule on scripted timings: MKL must win at two sizes in a row (one lucky size on a
    busy host does not move the crossover)."""
    wins = {4: True, 8: False, 32: True, 64: True, 128: True}
    timings = []
    monkeypatch.setattr(bf16_gemm, "_best", lambda fn, give_up=float("inf"): timings.pop(0))
    for m in bf16_gemm.CANDIDATES:
        timings += [1.0, 0.5 if wins.get(m) else 2.0]                     # own, then MKL
    assert bf16_gemm._measure(lib, cfg(1), [(64, 64)], 1, False) == 32
    timings[:] = [1.0, 2.0] * len(bf16_gemm.CANDIDATES)
    assert bf16_gemm._measure(lib, cfg(1), [(64, 64)], 1, False) == bf16_gemm.NEVER


def test_decoder_takes_the_measured_crossover_or_the_callers(lib, monkeypatch):
    runner = make_runner(model_dir("tiny"), dtype="bfloat16")
    monkeypatch.setattr(bf16_gemm, "_cache", {})
    monkeypatch.setattr(bf16_gemm, "_measure", lambda *a: 16)
    assert FusedDecoder(runner.model, runner.kv_caches, BLOCK, lib).bgemm_min_m == 16
    assert FusedDecoder(runner.model, runner.kv_caches, BLOCK, lib, bgemm_min_m=3).bgemm_min_m == 3
    fp32 = make_runner(model_dir("tiny"), dtype="float32")
    assert FusedDecoder(fp32.model, fp32.kv_caches, BLOCK, lib).bgemm_min_m == bf16_gemm.NEVER   # fp32: never
