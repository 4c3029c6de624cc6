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

from backend.config import EngineArgs
from backend.model import fused_decode
from backend.model.batch_builder import SeqChunk, build_batch
from backend.model.runner import ModelRunner
from kernels.cpu import decode_library
from tests.conftest import model_dir

BLOCK = 4
NUM_BLOCKS = 320                # room for the M = 40 case (~6 blocks per sequence)
RTOL = 1e-4



@pytest.fixture(scope="module", params=["tiny", "tiny-qwen2"])
def runner(request) -> ModelRunner:
    if decode_library() is None:
        pytest.skip("no C compiler: the fused decode step is unavailable")
    r = ModelRunner(str(model_dir(request.param)), EngineArgs(block_size=BLOCK, num_kv_blocks=NUM_BLOCKS,
                                                              num_threads=1))
    assert r.fused is not None
    return r


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


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    err = (a - b).abs().max().item()
    assert err <= RTOL * b.abs().max().item(), f"max abs diff {err}"


@pytest.mark.parametrize("m", [1, 3, 16])
def test_fused_step_matches_torch_path(runner, m):
    lengths = [random.Random(m).randrange(5, 23) for _ in range(m)]
    lengths[0] = 21                                      # spans 6 blocks of 4
    seqs = prefill(runner, lengths, seed=m)
    for step in range(2):                                # second step reads the first one's K/V
        batch = build_batch([SeqChunk([t[-1]], len(t), tab) for t, tab in seqs], BLOCK)
        fused, ref, kv_fused, kv_ref = both_paths(runner, batch)
        assert fused.shape == (m, runner.info.vocab_size) and fused.dtype == torch.float32
        assert_close(fused, ref)
        assert torch.equal(fused.argmax(-1), ref.argmax(-1))
        assert (kv_fused - kv_ref).abs().max().item() < 1e-5
        for (t, _), tok in zip(seqs, fused.argmax(-1).tolist()):
            t.append(tok)


def test_logits_rows_subset_and_order(runner):
    seqs = prefill(runner, [9, 14, 6], seed=5)
    batch = build_batch([SeqChunk([t[-1]], len(t), tab, logits=(i != 1)) for i, (t, tab) in enumerate(seqs)],
                        BLOCK)
    fused, ref, _, _ = both_paths(runner, batch)
    assert fused.shape[0] == 2
    assert_close(fused, ref)


def test_prefill_and_mixed_steps_keep_the_torch_path(runner):
    assert fused_decode.FusedDecoder.accepts(num_tokens=4, num_seqs=4)
    assert not fused_decode.FusedDecoder.accepts(num_tokens=5, num_seqs=4)


def test_bad_token_id_is_a_clear_error(runner):
    seqs = prefill(runner, [7], seed=9)
    t, tab = seqs[0]
    batch = build_batch([SeqChunk([runner.info.vocab_size + 5], len(t), tab)], BLOCK)
    with pytest.raises(ValueError, match="out of range"):
        runner.execute(batch)


def test_switch_and_no_compiler_fall_back(monkeypatch):
    from kernels import cpu

    path = str(model_dir("tiny"))
    args = EngineArgs(block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, num_threads=1)
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


def test_bf16_models_are_not_fused():
    path = str(model_dir("tiny"))
    assert ModelRunner(path, EngineArgs(block_size=BLOCK, num_kv_blocks=8, dtype="bfloat16")).fused is None


# Weight-only quantized models (issue 16): the fused step calls the quant library's w8_gemm / w4_gemm
# for QuantLinear projections (and a quantized lm_head), so it must agree with the quantized torch path
# (QuantLinear's C kernel) as tightly as the fp32 step agrees with the fp32 torch path.
@pytest.fixture(scope="module", params=[("tiny", "int8", False), ("tiny", "int4", False),
                                        ("tiny-qwen2", "int8", True), ("tiny", "int4", True)],
                ids=["int8", "int4", "qwen2-int8-head", "int4-head"])
def qrunner(request) -> ModelRunner:
    if decode_library() is None:
        pytest.skip("no C compiler: the fused decode step is unavailable")
    preset, method, head = request.param
    r = ModelRunner(str(model_dir(preset)), EngineArgs(block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, num_threads=1,
                                                       quantization=method, quant_lm_head=head))
    quant = [m for m in r.model.modules() if type(m).__name__ == "QuantLinear"]
    assert quant and all(m.method == method for m in quant)
    assert (r.model.lm_head_q is not None) == head
    assert r.fused is not None
    return r


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
    r = ModelRunner(str(tmp_path / "packed"), EngineArgs(block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, num_threads=1))
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
