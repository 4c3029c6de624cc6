"""The model's torch step with adapter rows on kernels/lora.py (LoRABatch kernel "triton") against
the same step on LoRABatch's torch path, under the interpreter: the tiny checkpoint, three PEFT
adapters (ranks 8, 16, 64; q/v, MLP, all seven targets) and base rows mixed in one step, with the
call sites of backend/model/llama.py as they are (fused qkv / gate_up column slices, o and down
on the attention output and the activation). The CPU engine itself runs adapter rows in the fused
C step (tests/unit/test_lora_fused_step.py); here the runner's torch path is forced.
"""
from __future__ import annotations

import random

import pytest
import torch

from backend.config import EngineConfig, LoRAConfig
from backend.lora.batch import LoRABatch
from backend.model.runner import SeqChunk, build_batch
from backend.model.runner import ModelRunner
from tests.unit.lora_helpers import make_adapters

BLOCK, NUM_BLOCKS = 4, 128


@pytest.fixture(scope="module")
def runner(tiny_model, tmp_path_factory):
    import kernels

    if not kernels.triton_available("cpu"):     # compiled for a GPU: test_lora_batch_dispatch.py runs there
        pytest.skip("needs the kernels interpreted on CPU (TRITON_INTERPRET=1, tests/kernels/conftest.py)")
    adapters = {k: str(v) for k, v in make_adapters(tiny_model, tmp_path_factory.mktemp("lora_tri")).items()}
    r = ModelRunner(str(tiny_model), EngineConfig(block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, num_threads=1,
                                                  attention_backend="torch"),
                    LoRAConfig(max_loras=3, lora_modules=adapters))
    r.fused = None                      # the model's torch step, where LoRABatch.add runs
    return r


def _run(r: ModelRunner, batch) -> torch.Tensor:
    """The step's logits from the same pool state each time (the K/V it stores are put back)."""
    before = r.storage.kv.clone()
    try:
        return r.execute(batch)
    finally:
        r.storage.kv.copy_(before)


def test_model_step_triton_lora_matches_torch_lora(runner):
    rng = random.Random(7)
    free = rng.sample(range(NUM_BLOCKS), NUM_BLOCKS)
    # (new tokens, adapter): prefill chunks and single rows of every adapter, base rows between
    case = [(9, "ada64"), (1, None), (5, "ada8"), (6, None), (1, "ada16"), (3, "ada64"), (1, "ada8"), (7, "ada16")]
    chunks, spans = [], []
    for new, name in case:
        table, free = free[:-(-new // BLOCK)], free[-(-new // BLOCK):]
        chunks.append(SeqChunk([rng.randrange(runner.info.vocab_size) for _ in range(new)], 0, table,
                               all_logits=True))
        spans.append((None if name is None else runner.loras.resolve(name), new))
    cfg = runner.config
    dims = {"q_size": cfg.num_heads * cfg.head_dim, "kv_size": cfg.num_kv_heads * cfg.head_dim,
            "intermediate": cfg.intermediate_size}
    plain, on_torch, on_triton = (build_batch(chunks, BLOCK) for _ in range(3))
    on_torch.lora = LoRABatch.build(spans, kernel="torch", **dims)
    on_triton.lora = LoRABatch.build(spans, kernel="triton", **dims)
    assert (on_torch.lora.kernel, on_triton.lora.kernel) == ("torch", "triton")
    want, got, base = _run(runner, on_torch), _run(runner, on_triton), _run(runner, plain)
    err = float((got - want).abs().max())
    assert err <= 1e-5 * float(want.abs().max()), err
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    rows = torch.cat([torch.full((n,), name is None) for n, name in case])
    assert torch.equal(got[rows], base[rows])              # base rows: not one bit moved
    assert (got[~rows] - base[~rows]).abs().max() > 1e-3   # adapter rows: moved
