"""Adapter rows in the fused C step of a bf16 model (weights read in place as bf16; the adapters,
bf16 like the model, widened exactly to fp32 for kernels/csrc/lora_cpu.c): a mixed step agrees with
the torch path to bf16's precision (the fused step's bf16 contract, tests/unit/test_model_dtype.py),
its base rows are exactly those of the same step without adapters, and its adapter rows move."""
from __future__ import annotations

import random

import pytest
import torch

from backend import LLM
from backend.lora.fused import rows_done
from backend.model.runner import SeqChunk, build_batch
from tests.unit import test_lora_fused_step as fs

BF16_RTOL = 3e-2


@pytest.fixture(scope="module")
def runner(tiny_model, adapters):
    llm = LLM(tiny_model, dtype="bfloat16", block_size=fs.BLOCK, num_kv_blocks=fs.NUM_BLOCKS, num_threads=1,
              max_loras=3, lora_modules=adapters)
    r = llm.engine.runner
    if r.fused is None:
        pytest.skip("no fused bf16 step on this CPU (neither AVX512-BF16 nor AVX2 + FMA)")
    return r


adapters = fs.adapters          # the same seeded PEFT adapters (module fixture)


def test_mixed_bf16_step_in_c(runner):
    rng = random.Random(4)
    free = rng.sample(range(fs.NUM_BLOCKS), fs.NUM_BLOCKS)
    case = [(0, 13, "ada64"), (9, 1, None), (6, 1, "ada16"), (0, 7, None), (11, 1, "ada8"), (3, 4, "ada16")]
    chunks, spans = [], []
    for cached, new, name in case:
        nb = -(-(cached + new) // fs.BLOCK)
        table, free = free[:nb], free[nb:]
        toks = [rng.randrange(runner.info.vocab_size) for _ in range(cached + new)]
        if cached:
            runner.fused, fused = None, runner.fused
            runner.execute(build_batch([SeqChunk(toks[:cached], 0, table)], fs.BLOCK))
            runner.fused = fused
        chunks.append(SeqChunk(toks[cached:], cached, table, all_logits=True))
        spans.append((None if name is None else runner.loras.resolve(name), new))
    assert runner.loras.resolve("ada8").layers[0]["q_proj"][0].dtype == torch.bfloat16
    plain = build_batch(chunks, fs.BLOCK)
    batch = build_batch(chunks, fs.BLOCK)
    batch.lora = fs.lora_batch(runner, spans)
    before = rows_done()
    got = fs.run(runner, batch, fused=True)
    assert rows_done() > before
    want = fs.run(runner, batch, fused=False)
    err = (got - want).abs().max().item()
    assert err <= BF16_RTOL * want.abs().max().item(), err
    base = fs.run(runner, plain, fused=True)
    rows = torch.cat([torch.full((n,), name is None) for _, n, name in case])
    assert torch.equal(got[rows], base[rows])
    assert (got[~rows] - base[~rows]).abs().max() > 1e-2
