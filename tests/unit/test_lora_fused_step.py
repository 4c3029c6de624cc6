"""Adapter rows inside the fused C step (kernels/csrc/lora_cpu.c, issue 31): a mixed step of base and
adapter rows agrees with the torch path (LoRABatch.add), its base rows are exactly those of the same
step without adapters, the thread count does not change a bit, and generation runs every adapter
row of every layer in C (the library's row counter), none on the torch path."""
from __future__ import annotations

import random

import pytest
import torch

from backend import LLM, SamplingParams
from backend.config import EngineConfig, LoRAConfig
from backend.lora.batch import LoRABatch
from backend.lora.fused import rows_done
from backend.model.runner import SeqChunk, build_batch
from backend.model.runner import ModelRunner
from kernels.cpu import decode_library
from tests.unit.lora_helpers import ADAPTERS, make_adapters

BLOCK, NUM_BLOCKS = 4, 256
# projections (qkv, o, gate_up, down) each test adapter touches: q/v; gate/up/down; all seven
PROJECTIONS = {"ada8": 1, "ada16": 2, "ada64": 4}


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    if decode_library() is None:
        pytest.skip("no C compiler: the fused step is unavailable")
    return {k: str(v) for k, v in make_adapters(tiny_model, tmp_path_factory.mktemp("fused")).items()}


@pytest.fixture(scope="module")
def runner(tiny_model, adapters):
    r = ModelRunner(str(tiny_model), EngineConfig(block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, num_threads=1),
                    LoRAConfig(max_loras=3, lora_modules=adapters))
    assert r.fused is not None
    return r


def lora_batch(r: ModelRunner, spans) -> LoRABatch:
    cfg = r.config
    return LoRABatch.build(spans, q_size=cfg.num_heads * cfg.head_dim, kv_size=cfg.num_kv_heads * cfg.head_dim,
                           intermediate=cfg.intermediate_size)


def run(r: ModelRunner, batch, *, fused: bool, threads: int = 1) -> torch.Tensor:
    """The step's logits from the same pool state each time (the K/V it stores are put back)."""
    before = r.storage.kv.clone()
    saved, threads0 = r.fused, torch.get_num_threads()
    if not fused:
        r.fused = None
    torch.set_num_threads(threads)
    try:
        return r.execute(batch)
    finally:
        r.fused = saved
        torch.set_num_threads(threads0)
        r.storage.kv.copy_(before)


def test_mixed_step_in_c(runner):
    rng = random.Random(3)
    free = rng.sample(range(NUM_BLOCKS), NUM_BLOCKS)
    # (cached tokens, new tokens, adapter): decodes and prefill chunks, every adapter, base rows between
    case = [(0, 19, "ada64"), (12, 1, None), (7, 1, "ada8"), (0, 9, None), (20, 1, "ada16"), (5, 6, "ada64"),
            (30, 1, "ada8"), (0, 26, "ada16"), (9, 1, None)]
    chunks, spans = [], []
    for cached, new, name in case:
        nb = -(-(cached + new) // BLOCK)
        table, free = free[:nb], free[nb:]
        toks = [rng.randrange(runner.info.vocab_size) for _ in range(cached + new)]
        if cached:                       # the cached part through the torch path first
            runner.fused, fused = None, runner.fused
            runner.execute(build_batch([SeqChunk(toks[:cached], 0, table)], BLOCK))
            runner.fused = fused
        chunks.append(SeqChunk(toks[cached:], cached, table, all_logits=True))
        spans.append((None if name is None else runner.loras.resolve(name), new))
    plain = build_batch(chunks, BLOCK)
    batch = build_batch(chunks, BLOCK)
    batch.lora = lora_batch(runner, spans)
    before = rows_done()
    got = run(runner, batch, fused=True)
    assert rows_done() > before                          # ran in C
    want = run(runner, batch, fused=False)
    err = (got - want).abs().max().item()
    assert err <= 1e-4 * want.abs().max().item(), err
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    base = run(runner, plain, fused=True)
    rows = torch.cat([torch.full((n,), name is None) for _, n, name in case])
    assert torch.equal(got[rows], base[rows])            # base rows: not one bit moved
    assert (got[~rows] - base[~rows]).abs().max() > 1e-3  # adapter rows: moved
    assert torch.equal(run(runner, batch, fused=True, threads=2), got)


def test_generation_runs_every_adapter_row_in_c(tiny_model, adapters):
    """Each fed token of an adapter request is counted once per layer and projection its adapter
    targets; a step on the torch path would leave the counter short."""
    g = torch.Generator().manual_seed(5)
    lengths = [7, 15, 4, 22, 11, 9]
    route = ["ada8", None, "ada16", "ada64", None, "ada64"]
    prompts = [torch.randint(3, 3000, (n,), generator=g).tolist() for n in lengths]
    llm = LLM(tiny_model, max_loras=3, num_kv_blocks=128, enable_prefix_caching=False, lora_modules=adapters)
    assert llm.engine.runner.fused is not None
    max_new = 6
    before = rows_done()
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=max_new, min_tokens=max_new, lora=a)
                                  for a in route])
    assert all(len(o.outputs[0].token_ids) == max_new for o in outs)
    layers = llm.engine.runner.config.num_layers
    # a request feeds its prompt and all but its last generated token
    want = sum((n + max_new - 1) * layers * PROJECTIONS[a] for n, a in zip(lengths, route) if a is not None)
    assert rows_done() - before == want
    assert set(PROJECTIONS) == set(ADAPTERS)
