"""dtype=auto, and the bf16 path pinned against transformers run in bf16 (docs/kernels.md's exactness
contract: fp32 is token-exact with transformers fp32; bf16 is compared with transformers bf16)."""
from __future__ import annotations

import pytest
import torch

from backend.model.runner import SeqChunk, build_batch
from backend.model.loader import auto_dtype, cpu_flags, parse_dtype
from tests.conftest import model_dir
from tests.unit.test_model_parity import BLOCK, Blocks, make_runner, prompts


@pytest.mark.parametrize("flags, want", [
    ({"avx2", "fma"}, "float32"),                        # AVX2-only (AMD Zen 3, older Xeons)
    ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),    # AVX-512 BF16 dot products
    ({"avx2", "avx512f", "amx_bf16", "amx_tile"}, "bfloat16"),
    (set(), "float32"),                                  # flags unknown
])
def test_auto_dtype_from_cpu_flags(flags, want):
    assert auto_dtype("cpu", flags) == want


def test_auto_dtype_cuda_and_this_machine(tmp_path):
    assert auto_dtype("cuda", set()) == "bfloat16"
    assert parse_dtype("auto") == getattr(torch, auto_dtype("cpu"))
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\n")
    assert cpu_flags(str(info)) == {"fpu", "avx2", "amx_bf16"}
    assert cpu_flags(str(tmp_path / "missing")) == set()
    with pytest.raises(ValueError, match="auto or one of"):
        parse_dtype("fp8")


@pytest.mark.parametrize("kernels", ["best", "avx2", "mkl", "own"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2"])
def test_bf16_matches_transformers_bf16(preset, kernels):
    """Prefill logits close to transformers' in bf16; on tiny, 8 greedy tokens equal to its generate.
    The bf16 fused step wherever the CPU has a bf16 kernel set (AVX512-BF16 or AVX2 + FMA: every
    x86-64 host since Haswell); "avx2" pins its AVX2 kernels (kernels/csrc/bf16_avx2.c) where the
    CPU would pick VDPBF16PS / AMX; "mkl" forces MKL's bf16 GEMM (backend/model/bf16_gemm.py) at every
    M, "own" the library's kernels at every M (the measured crossover picks between the two)."""
    from transformers import AutoModelForCausalLM

    from backend.model import bf16_gemm
    from backend.model.fused_decode import FusedDecoder
    from kernels.cpu import decode_library

    path = model_dir(preset)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    runner = make_runner(path, dtype="bfloat16")
    assert runner.storage.k_cache(0).dtype == torch.bfloat16
    lib = decode_library()
    if lib is not None and lib.bf16_supported():
        assert runner.fused is not None and runner.fused.bf16
    if kernels == "avx2":
        if lib is None or not lib.bf16_avx2_supported():
            pytest.skip("no AVX2 + FMA (or no C compiler): no AVX2 bf16 kernels")
        runner.fused = FusedDecoder(runner.model, runner.kv_caches, BLOCK, lib, bf16_avx2=True)
    if kernels in ("mkl", "own"):
        if lib is None or not lib.bf16_supported() or (kernels == "mkl" and bf16_gemm.mkl_symbols() is None):
            pytest.skip("no bf16 kernel set (or no MKL bf16 GEMM in torch's library)")
        runner.fused = FusedDecoder(runner.model, runner.kv_caches, BLOCK, lib,
                                    bgemm_min_m=1 if kernels == "mkl" else bf16_gemm.NEVER)
        assert runner.fused.bgemm_min_m == (1 if kernels == "mkl" else bf16_gemm.NEVER)
    seqs = prompts(runner.info.vocab_size, [9, 14], seed=3)
    blocks = Blocks(seed=4)
    tables = [blocks.take(len(s) + 8) for s in seqs]

    ours = runner.execute(build_batch([SeqChunk(s, 0, t, all_logits=True) for s, t in zip(seqs, tables)], BLOCK))
    with torch.inference_mode():
        ref = torch.cat([hf(torch.tensor([s])).logits[0].float() for s in seqs])
    # bf16 keeps ~3 significant digits; two bf16 implementations differ by their rounding points.
    assert (ours - ref).abs().max() <= 0.02 * ref.abs().max()
    if preset != "tiny":
        return      # tiny-qwen2's random weights give exact bf16 ties among top logits: argmax is a coin

    generated = [[] for _ in seqs]
    chunks = [SeqChunk(s, 0, t) for s, t in zip(seqs, tables)]
    for _ in range(8):
        nxt = runner.execute(build_batch(chunks, BLOCK)).argmax(-1).tolist()
        for i, tok in enumerate(nxt):
            generated[i].append(tok)
        chunks = [SeqChunk([tok], len(seqs[i]) + len(generated[i]) - 1, tables[i]) for i, tok in enumerate(nxt)]
    for s, gen in zip(seqs, generated):
        with torch.inference_mode():
            want = hf.generate(torch.tensor([s]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert gen == want[0, len(s):].tolist()
