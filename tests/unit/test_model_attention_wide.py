"""The C decode attention's 16-lane GQA-group rows (kernels/csrc/paged_avx512.h, AVX-512 builds, half
caches; fp32 caches keep the 8-lane rows either way) and its 8-lane rows both equal kernels.reference,
for every cache dtype, head dims with and without a 16-lane kernel, and GQA groups of 1, 3
(SmolLM2), 4 and 5 heads (split across register groups)."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu as cpu_kernels
from kernels.reference import paged_attention_ref

BS, NUM_BLOCKS = 16, 40
pytestmark = pytest.mark.skipif(not cpu_kernels.supports(torch.float32, "cpu"), reason="no C compiler")


def attend_case(dtype: torch.dtype, hq: int, hkv: int, d: int, wide: int, seed: int = 0):
    """Rows of 3 sequences (decodes and a causal prefill chunk) through cpu.attend; -> (got, want)."""
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = (torch.randn(NUM_BLOCKS, BS, hkv, d, generator=g).to(dtype) for _ in range(2))
    tables = torch.randperm(NUM_BLOCKS, generator=g)[:3 * 6].view(3, 6).to(torch.int32).contiguous()
    # sequence 0: one decode row at 37 tokens; 1: a chunk of 5 rows ending at 21; 2: one row at 3
    seq = torch.tensor([0, 1, 1, 1, 1, 1, 2], dtype=torch.int32)
    ctx = torch.tensor([37, 17, 18, 19, 20, 21, 3], dtype=torch.int32)
    q = torch.randn(len(seq), hq, d, generator=g)
    out = torch.full_like(q, float("nan"))
    lib = cpu_kernels.library()
    lib.paged_set_wide(wide)
    try:
        cpu_kernels.attend(q, k_cache, v_cache, tables, torch.arange(len(seq)), seq, ctx, 0.3, out)
    finally:
        lib.paged_set_wide(1)
    want = torch.empty_like(q)
    for i in range(len(seq)):       # each row as a 1-token query over its sequence's first ctx tokens
        want[i:i + 1] = paged_attention_ref(
            query=q[i:i + 1], k_cache=k_cache.float(), v_cache=v_cache.float(), block_tables=tables[seq[i]:seq[i] + 1],
            cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), seq_lens=ctx[i:i + 1], scale=0.3)
    return out, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("d", [32, 48, 64, 96, 128])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (9, 3), (8, 2), (10, 2)], ids=["g1", "g3", "g4", "g5"])
@pytest.mark.parametrize("wide", [1, 0], ids=["wide", "narrow"])
def test_attend_rows_match_reference(dtype, d, hq, hkv, wide):
    got, want = attend_case(dtype, hq, hkv, d, wide)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("d", [64, 128])
def test_wide_and_narrow_rows_agree(d):
    """Only the order of a score's D products differs: the two row kernels within fp32 rounding."""
    wide, _ = attend_case(torch.bfloat16, 9, 3, d, 1, seed=5)
    narrow, _ = attend_case(torch.bfloat16, 9, 3, d, 0, seed=5)
    torch.testing.assert_close(wide, narrow, atol=2e-6, rtol=1e-5)
