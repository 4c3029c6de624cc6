"""Our model's logits equal transformers' (fp32) through the paged cache, for both presets.

Every test uses shuffled block ids, so a wrong block-table lookup cannot pass by luck.
"""
from __future__ import annotations

import random

import pytest
import torch

from backend.config import EngineConfig
from backend.model.runner import SeqChunk, build_batch
from backend.model.runner import ModelRunner
from tests.conftest import model_dir

BLOCK = 4          # small blocks: every sequence spans several, chunks cross block boundaries
NUM_BLOCKS = 64
ATOL = 1e-4

PRESETS = ["tiny", "tiny-qwen2"]


@pytest.fixture(scope="module", params=PRESETS)
def preset(request):
    return request.param


@pytest.fixture(scope="module")
def hf_model(preset):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir(preset), dtype=torch.float32).eval()


def make_runner(path, **kw) -> ModelRunner:
    return ModelRunner(str(path), EngineConfig(block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, **kw))


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


class Blocks:
    """Hands out block ids in a shuffled order."""

    def __init__(self, seed: int = 0):
        self.free = random.Random(seed).sample(range(NUM_BLOCKS), NUM_BLOCKS)

    def take(self, n_tokens: int) -> list[int]:
        n = -(-n_tokens // BLOCK)
        out, self.free = self.free[:n], self.free[n:]
        return out


def prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def test_single_prompt_prefill(preset, hf_model):
    runner = make_runner(model_dir(preset))
    [ids] = prompts(runner.info.vocab_size, [21])
    batch = build_batch([SeqChunk(ids, 0, Blocks().take(21), all_logits=True)], BLOCK)
    out = runner.execute(batch)
    assert out.dtype == torch.float32 and out.shape == (21, runner.info.vocab_size)
    torch.testing.assert_close(out, hf_logits(hf_model, ids), atol=ATOL, rtol=0)


def test_mixed_lengths_one_flat_batch(preset, hf_model):
    runner = make_runner(model_dir(preset))
    seqs = prompts(runner.info.vocab_size, [1, 9, 4, 17, 2])
    blocks = Blocks(seed=3)
    batch = build_batch([SeqChunk(s, 0, blocks.take(len(s)), all_logits=True) for s in seqs], BLOCK)
    out = runner.execute(batch)
    rows = batch.cu_seqlens_q.tolist()
    for i, s in enumerate(seqs):
        torch.testing.assert_close(out[rows[i]:rows[i + 1]], hf_logits(hf_model, s), atol=ATOL, rtol=0)


def test_last_token_logits_only(preset, hf_model):
    runner = make_runner(model_dir(preset))
    seqs = prompts(runner.info.vocab_size, [6, 11])
    blocks = Blocks(seed=4)
    out = runner.execute(build_batch([SeqChunk(s, 0, blocks.take(len(s))) for s in seqs], BLOCK))
    assert out.shape == (2, runner.info.vocab_size)
    for i, s in enumerate(seqs):
        torch.testing.assert_close(out[i], hf_logits(hf_model, s)[-1], atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode_with_shared_prefix(preset, hf_model):
    """A: 3 prefill chunks (crossing block edges), then greedy decode steps.
    B: shares A's first 2 full blocks as a cached prefix, prefills the rest while A still prefills,
    then decodes while A prefills its last chunk (a mixed prefill/decode step), then both decode."""
    runner = make_runner(model_dir(preset))
    vocab = runner.info.vocab_size
    a, b_tail = prompts(vocab, [23, 7], seed=5)
    shared = 2 * BLOCK
    b = a[:shared] + b_tail
    blocks = Blocks(seed=6)
    table_a = blocks.take(40)
    table_b = table_a[:2] + blocks.take(40 - shared)
    got = {"a": [], "b": []}

    def step(chunks: dict[str, SeqChunk]):
        batch = build_batch(list(chunks.values()), BLOCK)
        out = runner.execute(batch)
        rows = batch.cu_seqlens_q.tolist()
        for i, key in enumerate(chunks):
            got[key].append(out[rows[i]:rows[i + 1]])

    def greedy(key: str, seq: list[int]) -> list[int]:
        return seq + [int(got[key][-1][-1].argmax())]

    step({"a": SeqChunk(a[:8], 0, table_a, all_logits=True)})
    step({"b": SeqChunk(b[shared:], shared, table_b, all_logits=True),
          "a": SeqChunk(a[8:17], 8, table_a, all_logits=True)})
    b = greedy("b", b)
    step({"a": SeqChunk(a[17:], 17, table_a, all_logits=True), "b": SeqChunk(b[-1:], len(b) - 1, table_b)})
    for _ in range(4):                         # decode A and B together
        a, b = greedy("a", a), greedy("b", b)
        step({"a": SeqChunk(a[-1:], len(a) - 1, table_a), "b": SeqChunk(b[-1:], len(b) - 1, table_b)})

    ref_a, ref_b = hf_logits(hf_model, a), hf_logits(hf_model, b)
    torch.testing.assert_close(torch.cat(got["a"]), ref_a[:len(a)], atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(got["b"]), ref_b[shared:len(b)], atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_close_to_fp32(preset, dtype):
    path = model_dir(preset)
    r32, r16 = make_runner(path), make_runner(path, dtype=dtype)
    assert r16.storage.k_cache(0).dtype == getattr(torch, dtype)
    seqs = prompts(r32.info.vocab_size, [12, 5])
    blocks = Blocks(seed=7)
    prefill = [SeqChunk(s, 0, blocks.take(len(s) + 1), all_logits=True) for s in seqs]
    decode = [SeqChunk([7], len(c.token_ids), c.block_table) for c in prefill]
    for chunks in (prefill, decode):
        out32 = r32.execute(build_batch(chunks, BLOCK))
        out16 = r16.execute(build_batch(chunks, BLOCK))
        assert out16.dtype == torch.float32
        tol = 0.05 * out32.abs().max()
        assert (out16 - out32).abs().max() < tol
        # Half precision picks the fp32 top token or a near-tie of it.
        picked = out32.gather(1, out16.argmax(-1, keepdim=True)).squeeze(1)
        assert (out32.max(-1).values - picked).max() < tol


def test_greedy_generation_matches_hf_generate(preset, hf_model):
    """SPEC 21: token-for-token equal to transformers' greedy generate (two prompts batched)."""
    runner = make_runner(model_dir(preset))
    seqs = prompts(runner.info.vocab_size, [5, 11], seed=9)
    blocks = Blocks(seed=10)
    tables = [blocks.take(len(s) + 16) for s in seqs]
    chunks = [SeqChunk(s, 0, t) for s, t in zip(seqs, tables)]
    generated = [[] for _ in seqs]
    for _ in range(16):
        nxt = runner.execute(build_batch(chunks, BLOCK)).argmax(-1).tolist()
        for i, tok in enumerate(nxt):
            generated[i].append(tok)
        chunks = [SeqChunk([tok], len(seqs[i]) + len(generated[i]) - 1, tables[i]) for i, tok in enumerate(nxt)]
    for s, gen in zip(seqs, generated):
        with torch.inference_mode():
            ref = hf_model.generate(torch.tensor([s]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert gen == ref[0, len(s):].tolist()
