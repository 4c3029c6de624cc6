"""The fused C decode step (backend/model/fused_decode.py) against the torch path of the same runner.

Same weights, same KV pool, same batch: logits must agree to 1e-4 relative and the K/V it stores
must be the ones the torch path stores. Both presets: ``tiny`` (GQA 4/2 heads, D 64, tied lm_head)
and ``tiny-qwen2`` (qkv bias, D 32, 8/2 heads, untied lm_head). Block size 4 and shuffled block ids,
so every sequence spans several blocks and a wrong table lookup cannot pass by luck.
"""
from __future__ import annotations

import random

import pytest
import torch

from backend.config import EngineConfig
from backend.model import fused_decode
from backend.model.runner import SeqChunk, build_batch
from backend.model.runner import ModelRunner
from kernels.cpu import decode_library
from tests.conftest import model_dir

BLOCK = 4
NUM_BLOCKS = 320                # room for the M = 40 case (~6 blocks per sequence)
RTOL = 1e-4



# (preset, kv_cache_dtype): a half KV cache (fp16 / bf16) is converted as stored by both paths (the
# torch path with torch's .to, the fused step in C) and read back widened to fp32, so the two must still
# agree as tightly as with fp32 KV
@pytest.fixture(scope="module", params=[("tiny", "auto"), ("tiny-qwen2", "auto"), ("tiny", "fp16"),
                                        ("tiny-qwen2", "bf16")], ids=lambda p: "-".join(p))
def runner(request) -> ModelRunner:
    if decode_library() is None:
        pytest.skip("no C compiler: the fused decode step is unavailable")
    preset, kv_dtype = request.param
    r = ModelRunner(str(model_dir(preset)), EngineConfig(block_size=BLOCK, num_kv_blocks=NUM_BLOCKS,
                                                       num_threads=1, kv_cache_dtype=kv_dtype))
    assert r.fused is not None
    assert r.storage.kv.dtype == {"auto": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[kv_dtype]
    return r


def assert_kv_close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Stored KV of the two paths: fp32 to 1e-5. A half cache: the two paths' fp32 K/V differ in the
    last bits, which flips a rounding now and then, and a flipped K/V read by the next layer's
    attention moves its K/V a little more: to 4 rounding steps of the type at the tensor's scale."""
    assert a.dtype == b.dtype
    eps = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}.get(a.dtype)
    a, b = a.float(), b.float()
    err = (a - b).abs().max().item()
    assert err <= (1e-5 if eps is None else 4 * eps * b.abs().max().item()), f"max abs diff {err}"


# logits of the two paths with a half KV cache (the flips above, through the attention)
HALF_RTOL = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def tol(r: ModelRunner) -> float:
    return HALF_RTOL.get(r.storage.kv.dtype, RTOL)


def prefill(r: ModelRunner, lengths: list[int], seed: int) -> list[tuple[list[int], list[int]]]:
    """Prefill one sequence per length (torch path); return (tokens, block table) per sequence, with
    room for 2 more tokens each."""
    rng = random.Random(seed)
    free = rng.sample(range(NUM_BLOCKS), NUM_BLOCKS)
    seqs = []
    for n in lengths:
        nb = -(-(n + 2) // BLOCK)
        table, free = free[:nb], free[nb:]
        seqs.append(([rng.randrange(r.info.vocab_size) for _ in range(n)], table))
    r.fused, fused = None, r.fused
    r.execute(build_batch([SeqChunk(t, 0, tab) for t, tab in seqs], BLOCK))
    r.fused = fused
    return seqs


def both_paths(r: ModelRunner, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fused logits, torch logits, KV after fused, KV after torch), each from the same pool state."""
    before = r.storage.kv.clone()
    fused_logits = r.execute(batch)
    kv_fused = r.storage.kv.clone()
    r.storage.kv.copy_(before)
    r.fused, fused = None, r.fused
    try:
        torch_logits = r.execute(batch)
    finally:
        r.fused = fused
    return fused_logits, torch_logits, kv_fused, r.storage.kv.clone()


def assert_close(a: torch.Tensor, b: torch.Tensor, rtol: float = RTOL) -> None:
    assert a.shape == b.shape
    err = (a - b).abs().max().item()
    assert err <= rtol * b.abs().max().item(), f"max abs diff {err}"


@pytest.mark.parametrize("m", [1, 3, 16])
def test_fused_step_matches_torch_path(runner, m):
    lengths = [random.Random(m).randrange(5, 23) for _ in range(m)]
    lengths[0] = 21                                      # spans 6 blocks of 4
    seqs = prefill(runner, lengths, seed=m)
    for step in range(2):                                # second step reads the first one's K/V
        batch = build_batch([SeqChunk([t[-1]], len(t), tab) for t, tab in seqs], BLOCK)
        fused, ref, kv_fused, kv_ref = both_paths(runner, batch)
        assert fused.shape == (m, runner.info.vocab_size) and fused.dtype == torch.float32
        assert_close(fused, ref, tol(runner))
        assert torch.equal(fused.argmax(-1), ref.argmax(-1))
        assert_kv_close(kv_fused, kv_ref)
        for (t, _), tok in zip(seqs, fused.argmax(-1).tolist()):
            t.append(tok)


def test_logits_rows_subset_and_order(runner):
    seqs = prefill(runner, [9, 14, 6], seed=5)
    batch = build_batch([SeqChunk([t[-1]], len(t), tab, logits=(i != 1)) for i, (t, tab) in enumerate(seqs)],
                        BLOCK)
    fused, ref, _, _ = both_paths(runner, batch)
    assert fused.shape[0] == 2
    assert_close(fused, ref, tol(runner))


# Varlen steps (issue 15): prefill chunks, alone or mixed with decodes, through the same C call.
# Each case: (cached tokens, new tokens, logits) per sequence; cached 0 = a prompt from scratch,
# cached > 0 = a chunk after a prefix already in the pool (a prefix-cache hit or an earlier chunk).
VARLEN = {
    "prefill": [(0, 13, True)],                                           # 4 blocks of 4
    "cached-start": [(9, 7, True)],                                       # starts mid-block
    "mixed": [(0, 11, True), (6, 1, True), (14, 1, True), (5, 6, True), (21, 1, True)],
    "no-logits-chunk": [(3, 1, True), (0, 10, False), (12, 5, True)],     # a chunk that does not sample
    "two-prompts": [(0, 5, True), (0, 17, True)],
}


def varlen_batch(r: ModelRunner, case: list[tuple[int, int, bool]], seed: int, all_logits: bool = False):
    """Prefill each sequence's cached part on the torch path; return the step's batch and per
    sequence (tokens so far, block table)."""
    cached = [c for c, _, _ in case if c]
    seqs = prefill(r, cached, seed=seed) if cached else []
    rng = random.Random(seed + 100)
    used = {b for _, tab in seqs for b in tab}
    free = [b for b in rng.sample(range(NUM_BLOCKS), NUM_BLOCKS) if b not in used]
    chunks, state, it = [], [], iter(seqs)
    for c, n, logits in case:
        if c:
            toks, tab = next(it)
            tab = tab + free[:2]                       # room for the chunk beyond prefill()'s + 2
            free = free[2:]
        else:
            toks, tab = [], []
        new = [rng.randrange(r.info.vocab_size) for _ in range(n)]
        need = -(-(c + n + 1) // BLOCK) - len(tab)
        tab, free = tab + free[:max(need, 0)], free[max(need, 0):]
        chunks.append(SeqChunk(new, c, tab, logits=logits, all_logits=all_logits and logits))
        state.append((toks + new, tab))
    return build_batch(chunks, BLOCK), state


@pytest.mark.parametrize("case", list(VARLEN))
def test_varlen_step_matches_torch_path(runner, case):
    """Logits (1e-4 rel), argmax and the stored K/V equal to the torch path; then a decode step of
    every sequence reads the K/V the fused varlen step wrote."""
    batch, state = varlen_batch(runner, VARLEN[case], seed=len(case))
    assert runner.fused.accepts(batch.input_ids.shape[0], batch.seq_lens.shape[0])
    fused, ref, kv_fused, kv_ref = both_paths(runner, batch)
    assert fused.shape == (sum(lg for _, _, lg in VARLEN[case]), runner.info.vocab_size)
    assert_close(fused, ref, tol(runner))
    assert torch.equal(fused.argmax(-1), ref.argmax(-1))
    assert_kv_close(kv_fused, kv_ref)
    runner.storage.kv.copy_(kv_fused)                  # continue from what the fused step stored
    step = build_batch([SeqChunk([t[-1]], len(t), tab) for t, tab in state], BLOCK)
    fused, ref, _, _ = both_paths(runner, step)
    assert_close(fused, ref, tol(runner))


def test_varlen_all_logits_rows(runner):
    """Logits for every row of a chunk (speculative verification's layout)."""
    batch, _ = varlen_batch(runner, [(7, 4, True), (10, 1, True), (0, 6, True)], seed=3, all_logits=True)
    fused, ref, _, _ = both_paths(runner, batch)
    assert fused.shape[0] == 11
    assert_close(fused, ref, tol(runner))


def test_varlen_long_prefill_blas_and_threads(runner):
    """70 + 3 rows: the linears take MKL's sgemm (M >= GEMM_MIN_M) where torch exports it, and the
    per-row loops and attention split over 2 threads; both equal the torch path."""
    batch, _ = varlen_batch(runner, [(0, 70, True), (9, 1, True), (4, 2, True)], seed=8)
    fused, ref, kv_fused, kv_ref = both_paths(runner, batch)
    assert_close(fused, ref, tol(runner))
    assert_kv_close(kv_fused, kv_ref)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two, _, kv_two, _ = both_paths(runner, batch)
    finally:
        torch.set_num_threads(threads)
    assert_close(two, fused, tol(runner))
    assert_kv_close(kv_two, kv_fused)


def test_token_budget_routes_steps(runner, monkeypatch):
    """All-decode steps are always fused; a step with a prefill chunk only within max_tokens
    (TRITON_LLM_FUSED_MAX_TOKENS at load); 0 keeps every prefill step on the torch path."""
    fused = runner.fused
    budget = fused.max_tokens
    try:
        fused.max_tokens = 8
        assert fused.accepts(num_tokens=4, num_seqs=4) and fused.accepts(num_tokens=40, num_seqs=40)
        assert fused.accepts(num_tokens=8, num_seqs=2) and not fused.accepts(num_tokens=9, num_seqs=2)
        fused.max_tokens = 0
        assert not fused.accepts(num_tokens=5, num_seqs=4)
        batch, _ = varlen_batch(runner, [(0, 6, True), (5, 1, True)], seed=4)
        monkeypatch.setattr(fused, "forward", lambda *a, **k: pytest.fail("a prefill step took the fused path"))
        assert runner.execute(batch).shape == (2, runner.info.vocab_size)
    finally:
        fused.max_tokens = budget
    monkeypatch.setenv("TRITON_LLM_FUSED_MAX_TOKENS", "0")
    assert fused_decode.max_tokens() == 0


def test_bad_sequence_layout_is_a_clear_error(runner):
    batch, _ = varlen_batch(runner, [(0, 5, True), (3, 2, True)], seed=6)
    bad = batch.seq_lens.clone()
    bad[0] = 2                                          # context shorter than the chunk
    with pytest.raises(ValueError, match="out of range"):
        runner.fused.forward(batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables, bad,
                             batch.logits_indices, batch.cu_seqlens_q)


def test_quantized_varlen_step_matches_quantized_torch_path(qrunner):
    """int8 / int4 projections in a mixed step (M = 20, below SMALL_M: the same C GEMM on both paths)."""
    test_varlen_step_matches_torch_path(qrunner, "mixed")


def test_bad_token_id_is_a_clear_error(runner):
    seqs = prefill(runner, [7], seed=9)
    t, tab = seqs[0]
    batch = build_batch([SeqChunk([runner.info.vocab_size + 5], len(t), tab)], BLOCK)
    with pytest.raises(ValueError, match="out of range"):
        runner.execute(batch)


def test_switch_and_no_compiler_fall_back(monkeypatch):
    from kernels import cpu

    path = str(model_dir("tiny"))
    args = EngineConfig(block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, num_threads=1)
    monkeypatch.setenv("TRITON_LLM_FUSED_DECODE", "0")
    assert ModelRunner(path, args).fused is None
    monkeypatch.delenv("TRITON_LLM_FUSED_DECODE")
    # No compiler: nothing builds, the decoder is off and a decode step still runs (torch path).
    monkeypatch.setattr(cpu, "_build", lambda *a, **k: None)
    cpu.decode_library.cache_clear()
    cpu.library.cache_clear()
    try:
        r = ModelRunner(path, args)
        assert r.fused is None
        seqs = prefill(r, [6, 11], seed=3)
        logits = r.execute(build_batch([SeqChunk([t[-1]], len(t), tab) for t, tab in seqs], BLOCK))
        assert logits.shape == (2, r.info.vocab_size) and torch.isfinite(logits).all()
    finally:
        cpu.decode_library.cache_clear()
        cpu.library.cache_clear()


def test_the_c_libraries_build_where_a_compiler_is_present():
    """Every fused-step test skips when the library is None ("no C compiler"), so a C source that
    stops compiling would turn them all into skips: where a compiler exists, both must build."""
    import shutil

    from kernels import cpu

    if not any(shutil.which(c) for c in ("cc", "gcc", "clang")) or cpu._disabled():
        pytest.skip("no C compiler here, or TRITON_LLM_CPU_KERNELS=0")
    assert cpu.library() is not None and decode_library() is not None


# bf16 models (where the CPU has AVX512-BF16): the fused step reads the bf16 weights in place and
# multiplies bf16-rounded inputs with fp32 accumulation (AMX tiles from 6 rows on, VDPBF16PS below
# that or where K % 32 != 0: tiny's down projection, K = 688), keeping norms, residual stream and
# attention in fp32; the torch path rounds every activation to bf16. The two are bf16 implementations
# rounding at different points: they agree to bf16's precision, not to 1e-4 (docs/kernels.md).
BF16_RTOL = 3e-2


def _bf16_lib():
    lib = decode_library()
    if lib is None or not lib.bf16_dot_supported():
        pytest.skip("no AVX512-BF16 on this CPU: bf16 models stay on the torch path")
    return lib


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen2"])
def brunner(request) -> ModelRunner:
    _bf16_lib()
    r = ModelRunner(str(model_dir(request.param)), EngineConfig(block_size=BLOCK, num_kv_blocks=NUM_BLOCKS,
                                                             num_threads=1, dtype="bfloat16"))
    assert r.fused is not None and r.fused.bf16 and r.storage.kv.dtype == torch.bfloat16
    return r


def test_bf16_packed_copies_share_one_huge_page_arena(brunner):
    """The packed bf16 copies a decode reads sit in one 2 MiB-aligned MADV_HUGEPAGE arena
    (loader.weight_arena), each 64-byte aligned, as the loader's weights do."""
    from backend.model import loader

    if not loader.huge_pages_enabled():
        pytest.skip("TRITON_LLM_HUGE_PAGES=0")
    packed = brunner.fused._packed
    assert packed and len({p.untyped_storage().data_ptr() for p in packed}) == 1
    assert packed[0].data_ptr() % loader.HUGE_PAGE == 0
    assert all(p.data_ptr() % 64 == 0 for p in packed)


def _assert_bf16_close(fused: torch.Tensor, ref: torch.Tensor) -> None:
    scale = ref.abs().max().item()
    assert (fused - ref).abs().max().item() <= BF16_RTOL * scale
    assert (fused - ref).abs().mean().item() <= BF16_RTOL / 6 * scale       # not one outlier: all close (~0.2 %)


@pytest.mark.parametrize("m", [1, 3, 16, 40])
def test_bf16_fused_step_matches_bf16_torch_path(brunner, m):
    """Decodes at M = 1 and 3 (VDPBF16PS), 16 and 40 (AMX, 40 = three token tiles): logits and
    stored K/V within bf16's precision of the torch path over two steps. Every step alternates the
    torch path's oneDNN bf16 matmuls (AMX too) with the fused step on this thread: each releases
    the tiles it configured, so neither finds a stale tile config (that faulted: SIGILL)."""
    lengths = [random.Random(m).randrange(5, 23) for _ in range(m)]
    seqs = prefill(brunner, lengths, seed=m)
    for _ in range(2):
        batch = build_batch([SeqChunk([t[-1]], len(t), tab) for t, tab in seqs], BLOCK)
        fused, ref, kv_fused, kv_ref = both_paths(brunner, batch)
        assert fused.shape == (m, brunner.info.vocab_size) and fused.dtype == torch.float32
        _assert_bf16_close(fused, ref)
        _assert_bf16_close(kv_fused.float(), kv_ref.float())
        brunner.storage.kv.copy_(kv_fused)
        for (t, _), tok in zip(seqs, fused.argmax(-1).tolist()):
            t.append(tok)


@pytest.mark.parametrize("case", ["mixed", "two-prompts", "all-logits"])
def test_bf16_varlen_step_matches_bf16_torch_path(brunner, case):
    """Varlen steps; "all-logits": every row of its chunks sampled (speculative verification's layout)."""
    if case == "all-logits":
        batch, _ = varlen_batch(brunner, [(7, 4, True), (10, 1, True), (0, 6, True)], seed=3, all_logits=True)
        assert batch.logits_indices.shape[0] == 11
    else:
        batch, _ = varlen_batch(brunner, VARLEN[case], seed=len(case))
    assert brunner.fused.accepts(batch.input_ids.shape[0], batch.seq_lens.shape[0])
    fused, ref, kv_fused, kv_ref = both_paths(brunner, batch)
    _assert_bf16_close(fused, ref)
    _assert_bf16_close(kv_fused.float(), kv_ref.float())


@pytest.mark.parametrize("shape", ["decode16", "varlen"])
def test_bf16_thread_count_and_pool_do_not_change_the_step(brunner, shape):
    test_thread_count_and_pool_do_not_change_the_step(brunner, shape)


@pytest.mark.parametrize("packed", [0, 1])
@pytest.mark.parametrize("amx", [1, 0])
@pytest.mark.parametrize("n,k", [(1, 32), (5, 20), (16, 64), (37, 96), (130, 33), (600, 256), (4100, 64)])
def test_bf16_linear_kernels_every_row_and_token_count(n, k, amx, packed):
    """``linear_bf16_test``: bf16(x) W^T (+ bias, + the residual) against float64 over the same
    bf16 values, AMX on and off (off: VDPBF16PS tiles for every M; on: AMX from 6 tokens where K %
    32 == 0, its N % 16 rows left to the VDPBF16PS tiles), on the row-major weight and on its packed
    copy (bf16_packed.c; odd K: the row-major tiles), 1 and 2 threads, bit-identical across thread
    counts."""
    lib = _bf16_lib()
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g)
    lib.amx_set(amx)
    try:
        for m in (1, 2, 3, 4, 5, 16, 17, 33):
            x = torch.randn(m, k, generator=g)
            y0 = torch.randn(m, n, generator=g)
            for bias, acc in ((None, 0), (b, 0), (b, 1)):
                want = (x.bfloat16().double() @ w.double().T + (0 if bias is None else bias.double())
                        + (y0.double() if acc else 0))
                outs = []
                for nt in (1, 2):
                    y = y0.clone()
                    assert lib.linear_bf16_test(x.data_ptr(), m, k, w.data_ptr(), None if bias is None else bias.data_ptr(),
                                                n, y.data_ptr(), acc, nt, 0, packed) == 0
                    outs.append(y)
                err = (outs[0].double() - want).abs().max().item()
                assert err <= 1e-5 * max(1.0, want.abs().max().item()), (m, bias is None, acc, err)
                assert torch.equal(outs[0], outs[1])
    finally:
        lib.amx_set(1)


@pytest.mark.parametrize("n,k", [(16, 64), (37, 96), (1030, 72)])
def test_packed_bf16_rows_do_not_depend_on_the_batch(n, k):
    """On packed weights (VDPBF16PS, AMX off) every output is one lane's sum in K order, so a row's
    bits are the same whatever the other rows of the call, its tile and the thread count: the first
    m rows of a 33-row call equal an m-row call's."""
    lib = _bf16_lib()
    if not lib.bf16_dot_supported():
        pytest.skip("no AVX512-BF16: the packed kernels are not built for this CPU")
    g = torch.Generator().manual_seed(n + k)
    w, b, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g), torch.randn(33, k, generator=g)
    lib.amx_set(0)
    try:
        def run(m, nt):
            y = torch.empty(m, n)
            assert lib.linear_bf16_test(x.data_ptr(), m, k, w.data_ptr(), b.data_ptr(), n, y.data_ptr(), 0, nt, 0, 1) == 0
            return y
        full = run(33, 2)
        for m in (1, 2, 5, 6, 7, 17):
            for nt in (1, 2):
                assert torch.equal(run(m, nt), full[:m]), (m, nt)
    finally:
        lib.amx_set(1)


def test_bf16_models_without_bf16_kernels_stay_on_the_torch_path(monkeypatch):
    """A CPU with neither AVX512-BF16 nor AVX2 + FMA (``bf16_supported()`` 0): the torch path; with
    either, the fused step (AVX2 hosts included, tests/unit/test_fused_bf16_avx2.py)."""
    lib = decode_library()
    if lib is None:
        pytest.skip("no C compiler: the fused decode step is unavailable")
    monkeypatch.setattr(lib, "bf16_supported", lambda: 0)
    path = str(model_dir("tiny"))
    assert ModelRunner(path, EngineConfig(block_size=BLOCK, num_kv_blocks=8, dtype="bfloat16")).fused is None
    monkeypatch.undo()
    if lib.bf16_supported():
        assert ModelRunner(path, EngineConfig(block_size=BLOCK, num_kv_blocks=8, dtype="bfloat16")).fused is not None


# Weight-only quantized models (issue 16): the fused step calls the quant library's w8_gemm / w4_gemm
# for QuantLinear projections (and a quantized lm_head), so it must agree with the quantized torch path
# (QuantLinear's C kernel) as tightly as the fp32 step agrees with the fp32 torch path.
@pytest.fixture(scope="module", params=[("tiny", "int8", False), ("tiny", "int4", False),
                                        ("tiny-qwen2", "int8", True), ("tiny", "int4", True)],
                ids=["int8", "int4", "qwen2-int8-head", "int4-head"])
def qrunner(request) -> ModelRunner:
    from backend.quant import cpu as qcpu

    if decode_library() is None:
        pytest.skip("no C compiler: the fused decode step is unavailable")
    preset, method, head = request.param
    r = ModelRunner(str(model_dir(preset)), EngineConfig(block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, num_threads=1,
                                                       quantization=method, quant_lm_head=head))
    quant = [m for m in r.model.modules() if type(m).__name__ == "QuantLinear"]
    assert quant and all(m.method == method for m in quant)
    assert (r.model.lm_head_q is not None) == head
    assert r.fused is not None
    # int8 per channel quantizes activations to int16 from A16_MIN_M rows on (backend/quant/cpu.py):
    # the two paths' fp32 activations differ by ~1e-7, which flips a few int16 roundings. Weight-only
    # loops for every M here, so fused vs torch path stays a strict 1e-4 comparison.
    setter = getattr(qcpu.library(), "w8_set_a16_min_m", None)    # absent: weight-only already
    if setter is None:
        yield r
        return
    setter(0)
    try:
        yield r
    finally:
        setter(qcpu.A16_MIN_M)


@pytest.mark.parametrize("m", [1, 3, 16])
def test_quantized_fused_step_matches_quantized_torch_path(qrunner, m):
    test_fused_step_matches_torch_path(qrunner, m)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_gguf_keep_quantized_model_is_fused(tmp_path, qtype):
    """A GGUF imported with --keep-quantized (packed int8 / int4 G 32 with zeros) takes the fused step."""
    from backend.model.gguf_import import import_gguf
    from tests.unit.test_gguf_import import write_gguf

    if decode_library() is None:
        pytest.skip("no C compiler: the fused decode step is unavailable")
    write_gguf(model_dir("tiny-qwen2"), tmp_path / "m.gguf", qtype=qtype)
    import_gguf(tmp_path / "m.gguf", tmp_path / "packed", progress=None, keep_quantized=True)
    r = ModelRunner(str(tmp_path / "packed"), EngineConfig(block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, num_threads=1))
    assert r.model.quantization["method"] == ("int8" if qtype == "Q8_0" else "int4")
    assert r.fused is not None
    test_fused_step_matches_torch_path(r, 3)


def test_quantized_fused_step_above_small_m(qrunner):
    """M = 40 > backend/quant/cpu.py's SMALL_M: the torch path dequantizes + BLAS there, the fused step
    keeps the C GEMM; same weights, so the logits still agree within the tolerance."""
    test_fused_step_matches_torch_path(qrunner, 40)


def test_quantized_two_threads_match_one(qrunner):
    test_two_threads_match_one(qrunner)


def test_two_threads_match_one(runner):
    """OpenMP splits the large linears' rows (M = 16: gate/up is over the threading threshold)."""
    seqs = prefill(runner, [random.Random(i).randrange(5, 23) for i in range(16)], seed=11)
    batch = build_batch([SeqChunk([t[-1]], len(t), tab) for t, tab in seqs], BLOCK)
    before, threads = runner.storage.kv.clone(), torch.get_num_threads()
    one = runner.execute(batch)
    runner.storage.kv.copy_(before)
    torch.set_num_threads(2)
    try:
        two = runner.execute(batch)
    finally:
        torch.set_num_threads(threads)
    assert_close(two, one)


def test_int4_models_send_long_prefill_steps_to_the_torch_path(qrunner, runner):
    """int4 projections: a step with prefill chunks is fused only up to QUANT_MAX_TOKENS new tokens
    (past that the torch path's dequantize + MKL is faster); int8 (packed) and fp32 keep the whole
    budget; all-decode steps always."""
    cap = fused_decode.QUANT_MAX_TOKENS
    q = qrunner.fused
    assert q.quantized and not runner.fused.quantized
    assert q.accepts(num_tokens=cap, num_seqs=2)
    assert q.accepts(num_tokens=cap + 1, num_seqs=2) == (not q.int4 and cap + 1 <= q.max_tokens)
    assert q.accepts(num_tokens=cap + 40, num_seqs=cap + 40)
    assert runner.fused.accepts(num_tokens=cap + 1, num_seqs=2) == (cap + 1 <= runner.fused.max_tokens)


@pytest.mark.parametrize("n,k", [(1, 8), (3, 20), (4, 16), (5, 64), (7, 9), (37, 72), (130, 33), (1030, 40), (4100, 64)])
def test_linear_kernels_every_row_and_token_count(n, k):
    """The fused step's own fp32 linear (``linear_f32``: row parts read side by side, register tiles
    of 1-4 tokens, the < 4 rows left over, K tails) against float64, with and without bias and the
    residual add, 1 and 2 threads (4100 x 64 at 17 tokens is above the threading threshold: two
    row ranges)."""
    lib = decode_library()
    if lib is None:
        pytest.skip("no C compiler: the fused decode step is unavailable")
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    for m in (1, 2, 3, 4, 5, 8, 17):
        x = torch.randn(m, k, generator=g)
        y0 = torch.randn(m, n, generator=g)
        for bias, acc, nt in ((None, 0, 1), (b, 0, 1), (b, 1, 1), (None, 1, 2), (b, 0, 2)):
            want = x.double() @ w.double().T + (0 if bias is None else bias.double()) + (y0.double() if acc else 0)
            y = y0.clone()
            lib.linear_f32(x.data_ptr(), m, k, w.data_ptr(), None if bias is None else bias.data_ptr(), n,
                           y.data_ptr(), acc, nt)
            err = (y.double() - want).abs().max().item()
            assert err <= 1e-5 * max(1.0, want.abs().max().item()), (m, bias is None, acc, nt, err)


def test_weights_sit_in_one_huge_page_arena(monkeypatch):
    """The loader places every parameter in one 2 MiB-aligned arena advised for transparent huge
    pages (backend/model/loader.py): each 64-byte aligned, no two overlapping, values identical to
    torch's own allocations (TRITON_LLM_HUGE_PAGES=0), and the fused step's logits bit-identical."""
    from backend.model.config import load_model_config
    from backend.model.loader import HUGE_PAGE, load_model

    if decode_library() is None:
        pytest.skip("no C compiler: the fused decode step is unavailable")
    d = model_dir("tiny-qwen2")
    cfg = load_model_config(d)
    arena = load_model(d, cfg, dtype=torch.float32)
    monkeypatch.setenv("TRITON_LLM_HUGE_PAGES", "0")
    plain = load_model(d, cfg, dtype=torch.float32)
    ps = list(arena.parameters())
    base = min(p.data_ptr() for p in ps)
    assert base % HUGE_PAGE == 0
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in ps)
    assert all(a % 64 == 0 for a, _ in spans)
    assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:]))
    assert all(p.untyped_storage().data_ptr() == ps[0].untyped_storage().data_ptr() for p in ps)
    assert len({p.untyped_storage().data_ptr() for p in plain.parameters()}) == len(list(plain.parameters()))
    for (name, a), (_, b) in zip(arena.named_parameters(), plain.named_parameters()):
        assert a.is_contiguous() and torch.equal(a, b), name
    # quantized at load: the float projections are dropped, so torch's allocations (no dead arena)
    monkeypatch.delenv("TRITON_LLM_HUGE_PAGES")
    q = load_model(d, cfg, dtype=torch.float32, quantization="int8")
    assert len({p.untyped_storage().data_ptr() for p in q.parameters()}) > 1


def test_huge_page_weights_give_the_same_fused_logits(monkeypatch):
    if decode_library() is None:
        pytest.skip("no C compiler: the fused decode step is unavailable")
    out = []
    for env in ("1", "0"):
        monkeypatch.setenv("TRITON_LLM_HUGE_PAGES", env)
        r = ModelRunner(str(model_dir("tiny")), EngineConfig(block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, num_threads=1))
        assert r.fused is not None
        seqs = prefill(r, [9, 14], seed=5)
        out.append(r.execute(build_batch([SeqChunk([t[-1]], len(t), tab) for t, tab in seqs], BLOCK)))
    assert torch.equal(out[0], out[1])


def _step_with(r: ModelRunner, batch, threads: int, pool: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, KV after) of one fused step from the current pool state, which is restored."""
    lib = decode_library()
    before, saved = r.storage.kv.clone(), torch.get_num_threads()
    lib.step_pool_set(int(pool))
    torch.set_num_threads(threads)
    try:
        logits = r.execute(batch)
        return logits, r.storage.kv.clone()
    finally:
        torch.set_num_threads(saved)
        lib.step_pool_set(1)
        r.storage.kv.copy_(before)


@pytest.mark.parametrize("shape", ["decode16", "decode40", "varlen"])
def test_thread_count_and_pool_do_not_change_the_step(runner, shape):
    """Each output element is computed by one chunk with the same instructions whoever runs it, so
    one thread, two threads on the step's worker pool and two on OpenMP regions give bit-identical
    logits and K/V (an engine may pick its thread count per step without changing outputs)."""
    if shape == "varlen":
        batch, _ = varlen_batch(runner, [(0, 70, True), (9, 1, True), (4, 2, True), (3, 5, True)], seed=5)
    else:
        m = int(shape[len("decode"):])
        seqs = prefill(runner, [random.Random(i).randrange(5, 23) for i in range(m)], seed=m)
        batch = build_batch([SeqChunk([t[-1]], len(t), tab) for t, tab in seqs], BLOCK)
    one, kv_one = _step_with(runner, batch, 1, True)
    for pool in (True, False):
        two, kv_two = _step_with(runner, batch, 2, pool)
        assert torch.equal(two, one), pool
        assert torch.equal(kv_two, kv_one), pool


def test_linear_pool_is_exact_and_serves_concurrent_callers():
    """The fp32 linear over the pool (4100 x 64 at 17 tokens: above the threading threshold, 4 row
    chunks per thread) equals the one-thread result bit for bit, also when two threads call it at
    once (the second caller finds the pool busy and runs its loop alone)."""
    import threading

    lib = decode_library()
    if lib is None:
        pytest.skip("no C compiler: the fused decode step is unavailable")
    g = torch.Generator().manual_seed(7)
    n, k, m = 4100, 64, 17
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    xs = [torch.randn(m, k, generator=g) for _ in range(4)]

    def run(x: torch.Tensor, nt: int) -> torch.Tensor:
        y = torch.empty(m, n)
        lib.linear_f32(x.data_ptr(), m, k, w.data_ptr(), b.data_ptr(), n, y.data_ptr(), 0, nt)
        return y

    want = [run(x, 1) for x in xs]
    for pool in (1, 0):
        lib.step_pool_set(pool)
        try:
            assert all(torch.equal(run(x, 2), y) for x, y in zip(xs, want))
        finally:
            lib.step_pool_set(1)
    bad: list[int] = []

    def caller(i: int) -> None:
        for r in range(50):
            j = (i + r) % len(xs)
            if not torch.equal(run(xs[j], 2), want[j]):
                bad.append(j)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
