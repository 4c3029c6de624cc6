"""The fused step's AVX2 bf16 kernels (kernels/csrc/bf16_avx2.c): bf16 weights widened in registers,
inputs rounded to bf16, fp32 FMA accumulation -- the VDPBF16PS path's contract on every x86-64 host.

They run on any host with AVX2 + FMA: on an AVX512-BF16 host through the Model's ``bf16_avx2`` flag
(``FusedDecoder(..., bf16_avx2=True)``, ``linear_bf16_test(..., avx2=1)``), and unforced in a copy
of the decode library built for x86-64-v3 (AVX2, no AVX-512), i.e. as an AVX2-only host runs it.
"""
from __future__ import annotations

import platform
import random

import pytest
import torch

from backend.config import EngineConfig
from backend.model.runner import SeqChunk, build_batch
from backend.model.fused_decode import FusedDecoder
from backend.model.runner import ModelRunner
from kernels import cpu
from tests.conftest import model_dir
from tests.unit import test_model_fused_decode as fd

BLOCK, NUM_BLOCKS = fd.BLOCK, fd.NUM_BLOCKS


@pytest.fixture(scope="module")
def lib():
    lib = cpu.decode_library()
    if lib is None or not lib.bf16_avx2_supported():
        pytest.skip("no C compiler, or not an AVX2 + FMA CPU")
    return lib


@pytest.fixture(scope="module")
def avx2_only_lib():
    """The decode library built for x86-64-v3 (AVX2 + FMA + F16C, no AVX-512): what an AVX2-only
    host loads. Its bf16 models must take the AVX2 kernels without being told."""
    if platform.machine() != "x86_64" or cpu.decode_library() is None:
        pytest.skip("x86-64 with a C compiler only")
    path = cpu._build(cpu.DECODE_SOURCE, ["-O3", "-march=x86-64-v3", "-fopenmp", "-shared", "-fPIC"],
                      extra=cpu.DECODE_EXTRA)
    if path is None:
        pytest.skip("the compiler does not know -march=x86-64-v3")
    return cpu.load_decode(path)


def linear(lib, x, w, bias, y0, acc: int, nt: int, avx2: int, packed: int = 0) -> torch.Tensor:
    y = y0.clone()
    m, k = x.shape
    assert lib.linear_bf16_test(x.data_ptr(), m, k, w.data_ptr(), None if bias is None else bias.data_ptr(),
                                w.shape[0], y.data_ptr(), acc, nt, avx2, packed) == 0
    return y


# K tails (K % 16 != 0: the scalar tail; K < 16: tail only), N tails (N % 4: the rows left over the
# STREAMS parts), and a linear big enough for 2 threads (PAR_MIN_MACS) with several row chunks each.
@pytest.mark.parametrize("packed", [0, 1])
@pytest.mark.parametrize("n,k", [(1, 16), (5, 20), (16, 64), (37, 100), (130, 33), (600, 256), (4100, 72), (3, 7)])
def test_avx2_linear_against_float64(lib, n, k, packed):
    """bf16(x) W^T (+ bias, + the residual) against float64 over the same bf16 values for M 1..33;
    1 and 2 threads bit-identical; every row of an M-row call bit-identical to that row alone
    (every tile shape runs the same FMAs per output). ``packed``: on the weight's packed copy
    (bf16_packed.c, from 4 rows; odd K: the row-major tiles), whose rows are bit-identical across
    calls of 4 rows or more."""
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g)
    for m in (1, 2, 3, 4, 5, 7, 16, 17, 33):
        x = torch.randn(m, k, generator=g)
        y0 = torch.randn(m, n, generator=g)
        for bias, acc in ((None, 0), (b, 0), (b, 1)):
            want = x.bfloat16().double() @ w.double().T + (0 if bias is None else bias.double()) + (y0.double() if acc else 0)
            one, two = (linear(lib, x, w, bias, y0, acc, nt, 1, packed) for nt in (1, 2))
            err = (one.double() - want).abs().max().item()
            assert err <= 1e-5 * max(1.0, want.abs().max().item()), (m, bias is None, acc, err)
            assert torch.equal(one, two), m
            if packed:
                if m > 4 and acc == 0:
                    assert torch.equal(one[:4], linear(lib, x[:4], w, bias, y0[:4], 0, 1, 1, packed)), m
            elif m > 1 and acc == 0:
                alone = torch.cat([linear(lib, x[t:t + 1], w, bias, y0[t:t + 1], 0, 1, 1) for t in range(m)])
                assert torch.equal(one, alone), m


def test_avx2_linear_rounds_inputs_like_vdpbf16ps(lib):
    """Inputs are rounded to bf16 (RNE), not truncated and not kept in fp32: x = 1 + 2^-8 + 2^-10
    rounds up to 1 + 2^-7, and 1 + 2^-8 (a tie) to even, 1. Against the VDPBF16PS kernels where the
    CPU has them: the same values up to fp32 summation order."""
    w = torch.ones(4, 16).bfloat16()
    x = torch.full((1, 16), 1 + 2 ** -8 + 2 ** -10)
    assert torch.equal(linear(lib, x, w, None, torch.zeros(1, 4), 0, 1, 1), torch.full((1, 4), 16 * (1 + 2 ** -7)))
    x = torch.full((1, 16), 1 + 2 ** -8)
    assert torch.equal(linear(lib, x, w, None, torch.zeros(1, 4), 0, 1, 1), torch.full((1, 4), 16.0))
    # one-hot weights read each input back: every element rounded as torch rounds it (ties both
    # ways, signs, subnormals, near bf16's largest), in the 16-blocks and in the tail
    vals = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), -(1 + 3 * 2 ** -8), 0.1, -0.3, 1e-40, -3e-39,
                         3.3e38, -1e38, 0.0, -0.0, 65504.0, 2 ** -126, 7.0, 1 / 3, 2.5e-5, 1 + 2 ** -9, -1e-20])
    x = torch.stack([vals, vals.flip(0)])
    eye = torch.eye(vals.numel()).bfloat16()
    for m in (1, 2):
        got = linear(lib, x[:m], eye, None, torch.zeros(m, vals.numel()), 0, 1, 1)
        assert torch.equal(got, x[:m].bfloat16().float())
    if lib.bf16_dot_supported():
        g = torch.Generator().manual_seed(5)
        w, x = torch.randn(300, 576, generator=g).bfloat16(), torch.randn(9, 576, generator=g)
        a, d = (linear(lib, x, w, None, torch.zeros(9, 300), 0, 1, v) for v in (1, 0))
        assert (a - d).abs().max().item() <= 1e-5 * d.abs().max().item()
        assert not torch.equal(a, d)        # another summation order: the flag did reach the kernels


def test_avx2_only_build_serves_bf16_through_the_avx2_kernels(avx2_only_lib):
    lib = avx2_only_lib
    assert lib.bf16_dot_supported() == 0 and lib.amx_supported() == 0
    assert lib.bf16_avx2_supported() == 1 and lib.bf16_supported() == 1
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(70, 40, generator=g).bfloat16(), torch.randn(70, generator=g)
    x, y0 = torch.randn(6, 40, generator=g), torch.randn(6, 70, generator=g)
    want = x.bfloat16().double() @ w.double().T + b.double() + y0.double()
    got = linear(lib, x, w, b, y0, 1, 2, 0)                 # not forced: the only bf16 kernels there
    assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


# Whole steps: a bf16 runner whose fused step is swapped for one on the AVX2 kernels (forced, or the
# x86-64-v3 library), against the bf16 torch path with the tolerances of the VDPBF16PS tests.
@pytest.fixture(scope="module", params=[("tiny", "forced"), ("tiny-qwen2", "forced"), ("tiny", "x86-64-v3")],
                ids="-".join)
def arunner(request, lib) -> ModelRunner:
    preset, variant = request.param
    r = ModelRunner(str(model_dir(preset)), EngineConfig(block_size=BLOCK, num_kv_blocks=NUM_BLOCKS,
                                                       num_threads=1, dtype="bfloat16"))
    assert r.fused is not None and r.fused.bf16, "AVX2 + FMA: bf16 models take the fused step"
    step_lib = request.getfixturevalue("avx2_only_lib") if variant == "x86-64-v3" else lib
    r.fused = FusedDecoder(r.model, r.kv_caches, BLOCK, step_lib, bf16_avx2=variant == "forced")
    r.step_lib = step_lib
    return r


@pytest.mark.parametrize("m", [1, 3, 16, 40])
def test_avx2_decode_steps_match_bf16_torch_path(arunner, m):
    """Decodes of 1, 3, 16 and 40 sequences, two steps each: logits and stored K/V within bf16's
    precision of the torch path (the torch path's own oneDNN bf16 matmuls in between)."""
    lengths = [random.Random(m).randrange(5, 23) for _ in range(m)]
    seqs = fd.prefill(arunner, lengths, seed=m)
    for _ in range(2):
        batch = build_batch([SeqChunk([t[-1]], len(t), tab) for t, tab in seqs], BLOCK)
        fused, ref, kv_fused, kv_ref = fd.both_paths(arunner, batch)
        assert fused.shape == (m, arunner.info.vocab_size)
        fd._assert_bf16_close(fused, ref)
        fd._assert_bf16_close(kv_fused.float(), kv_ref.float())
        arunner.storage.kv.copy_(kv_fused)
        for (t, _), tok in zip(seqs, fused.argmax(-1).tolist()):
            t.append(tok)


@pytest.mark.parametrize("case", ["mixed", "two-prompts", "all-logits", "blas"])
def test_avx2_varlen_steps_match_bf16_torch_path(arunner, case):
    """Varlen steps; "blas": 78 rows, past GEMM_MIN_M: BLAS on the weights widened block by block."""
    if case == "blas":
        batch, _ = fd.varlen_batch(arunner, [(0, 70, True), (9, 1, True), (4, 2, True), (3, 5, True)], seed=6)
    elif case == "all-logits":
        batch, _ = fd.varlen_batch(arunner, [(7, 4, True), (10, 1, True), (0, 6, True)], seed=3, all_logits=True)
    else:
        batch, _ = fd.varlen_batch(arunner, fd.VARLEN[case], seed=len(case))
    assert arunner.fused.accepts(batch.input_ids.shape[0], batch.seq_lens.shape[0])
    fused, ref, kv_fused, kv_ref = fd.both_paths(arunner, batch)
    fd._assert_bf16_close(fused, ref)
    fd._assert_bf16_close(kv_fused.float(), kv_ref.float())


@pytest.mark.parametrize("shape", ["decode16", "varlen"])
def test_avx2_thread_count_and_pool_do_not_change_the_step(arunner, shape):
    """One thread, two on the step's pool, two on OpenMP regions: bit-identical logits and K/V."""
    if shape == "varlen":
        batch, _ = fd.varlen_batch(arunner, [(0, 70, True), (9, 1, True), (4, 2, True), (3, 5, True)], seed=5)
    else:
        seqs = fd.prefill(arunner, [random.Random(i).randrange(5, 23) for i in range(16)], seed=16)
        batch = build_batch([SeqChunk([t[-1]], len(t), tab) for t, tab in seqs], BLOCK)
    lib, saved, before = arunner.step_lib, torch.get_num_threads(), arunner.storage.kv.clone()
    outs = []
    try:
        for threads, pool in ((1, 1), (2, 1), (2, 0)):
            lib.step_pool_set(pool)
            torch.set_num_threads(threads)
            arunner.storage.kv.copy_(before)
            outs.append((arunner.execute(batch), arunner.storage.kv.clone()))
    finally:
        torch.set_num_threads(saved)
        lib.step_pool_set(1)
        arunner.storage.kv.copy_(before)
    for logits, kv in outs[1:]:
        assert torch.equal(logits, outs[0][0]) and torch.equal(kv, outs[0][1])
