"""``kv_cache_dtype`` (fp16 / bf16 KV pool under fp32 weights, CPU): the conversion the fused step
stores K/V with, the paged attention kernels on half caches (odd shapes) against the reference on
the same cache, the pool's size and dtype, greedy output of an engine against one whose reference
rounds K/V the same way, and the prefill -> decode hand-over moving half-size blocks.

The default (``auto``) keeps the model's dtype, so fp32 outputs stay token-exact with transformers
(tests/unit/test_model_parity.py); fp16 / bf16 KV are an explicit trade (docs/kernels.md).
"""
from __future__ import annotations

import pytest
import torch

from backend.config import EngineArgs, EngineConfig
from backend.disagg.pair import DisaggPair
from backend.disagg.shm import SharedMemoryConnector
from backend.engine.llm_engine import LLMEngine
from backend.model.loader import kv_cache_torch_dtype
from backend.engine.admission import SamplingParams
from kernels import cpu
from kernels.reference import paged_attention_ref
from tests.conftest import model_dir

HALF = [torch.float16, torch.bfloat16]
NAME = {torch.float16: "fp16", torch.bfloat16: "bf16"}


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    if cpu.library() is None:
        pytest.skip("no C compiler: the CPU kernels are unavailable")


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: NAME[d])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1003])
def test_conversion_is_torchs_round_to_nearest_even(dtype, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.logspace(-9, 5, n) if n > 1 else torch.tensor([1.0 + 2 ** -11])
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 65504.0, 65519.9, 65520.0,
                            1e6, 6e-8, 3e-8, -1e-7, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, 1.0 + 2 ** -8,
                            1.0 + 3 * 2 ** -8, 3.4e38])
    x = torch.cat([x, special[: max(0, n - 1)]])          # odd lengths: the vector loop's tail too
    got, want = cpu.to_half(x, dtype), x.to(dtype)
    same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
    assert bool(same.all()), (x[~same], got[~same], want[~same])


def _pool(dtype, num_blocks, bs, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(num_blocks, bs, hkv, d, generator=g) * 2).to(dtype)
    v = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    return k, v


# (hq, hkv, d, block_size, contexts): the vector kernels (d 32/48/64/128, all heads per block, the
# next block prefetched) and the plain loops (d 40, 8); GQA; block sizes that do not divide the
# contexts; contexts of 1 token and 4k-1 / 4k+1 (the 4-token score groups' tails)
SHAPES = [(6, 6, 48, 16, [1, 3, 17, 50]), (8, 2, 64, 5, [2, 9, 33]), (4, 1, 32, 7, [1, 13, 29]),
          (4, 2, 128, 16, [16, 31]), (6, 3, 40, 4, [5, 11]), (2, 2, 8, 3, [1, 4, 10])]


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=lambda d: NAME.get(d, "fp32"))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"hq{s[0]}-hkv{s[1]}-d{s[2]}-bs{s[3]}")
def test_attend_half_cache_matches_reference_on_the_same_cache(dtype, shape):
    """The C kernel reads the half cache widened to fp32: equal (to fp32 summation order) to the
    reference, which widens the same cache before its fp32 SDPA."""
    hq, hkv, d, bs, ctxs = shape
    per_seq = [-(-c // bs) for c in ctxs]
    nblocks = sum(per_seq) + 3
    k, v = _pool(dtype, nblocks, bs, hkv, d, seed=d + bs)
    perm = torch.randperm(nblocks, generator=torch.Generator().manual_seed(1)).tolist()
    width = max(per_seq) + 1
    tables = torch.zeros(len(ctxs), width, dtype=torch.int32)
    for s, nb in enumerate(per_seq):
        tables[s, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
        perm = perm[nb:]
    q = torch.randn(len(ctxs), hq, d, generator=torch.Generator().manual_seed(2))
    scale = d ** -0.5
    out = torch.full_like(q, float("nan"))
    cpu.attend(q, k, v, tables, torch.arange(len(ctxs)), torch.arange(len(ctxs), dtype=torch.int32),
               torch.tensor(ctxs, dtype=torch.int32), scale, out)
    want = paged_attention_ref(query=q, k_cache=k, v_cache=v, block_tables=tables,
                               cu_seqlens_q=torch.arange(len(ctxs) + 1, dtype=torch.int32),
                               seq_lens=torch.tensor(ctxs, dtype=torch.int32), scale=scale)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: NAME[d])
def test_store_converts_into_a_half_cache(dtype):
    """TorchAttention's store (C store_kv of torch-rounded rows): slot -1 skipped, others rounded."""
    from backend.model.attention import AttentionMetadata, TorchAttention

    bs, hkv, d = 4, 2, 40
    k, v = _pool(dtype, 6, bs, hkv, d, seed=3)
    before_k, before_v = k.clone(), v.clone()
    key, value = torch.randn(5, hkv, d), torch.randn(5, hkv, d)
    slots = torch.tensor([0, 7, -1, 13, 22])
    meta = AttentionMetadata(slot_mapping=slots, block_tables=torch.tensor([[0, 1, 3, 5]], dtype=torch.int32),
                             cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32),
                             seq_lens=torch.tensor([5], dtype=torch.int32))
    # the step's K/V are stored before attending; the query is 5 tokens (a prefill chunk)
    TorchAttention().forward(torch.randn(5, hkv, d), key, value, k, v, meta, d ** -0.5)
    flat_k, flat_v = k.view(-1, hkv, d), v.view(-1, hkv, d)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s], key[i].to(dtype)) and torch.equal(flat_v[s], value[i].to(dtype))
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[[s for s in slots.tolist() if s >= 0]] = False
    assert torch.equal(flat_k[untouched], before_k.view(-1, hkv, d)[untouched])
    assert torch.equal(flat_v[untouched], before_v.view(-1, hkv, d)[untouched])


def test_option_values_and_pool():
    assert kv_cache_torch_dtype(EngineConfig()) == torch.float32
    assert kv_cache_torch_dtype(EngineConfig(dtype="bfloat16")) == torch.bfloat16
    assert kv_cache_torch_dtype(EngineConfig(kv_cache_dtype="fp16")) == torch.float16
    assert kv_cache_torch_dtype(EngineConfig(kv_cache_dtype="bfloat16")) == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="fp8")
    assert EngineArgs.from_dict({"kv_cache_dtype": "bf16"}).engine.kv_cache_dtype == "bf16"


def test_a_half_pool_holds_twice_the_blocks_of_the_same_budget():
    from backend.context import num_kv_blocks
    from backend.model.config import load_model_config

    cfg = load_model_config(model_dir("tiny"))
    fp32 = num_kv_blocks(cfg, EngineConfig(kv_cache_memory=1 << 24))
    for kv in ("fp16", "bf16"):
        assert num_kv_blocks(cfg, EngineConfig(kv_cache_memory=1 << 24, kv_cache_dtype=kv)) == 2 * fp32
        assert LLMEngine(model_dir("tiny"), EngineConfig(num_threads=1, kv_cache_memory=1 << 24,
                                                       kv_cache_dtype=kv)).kv.num_blocks == 2 * fp32


GREEDY = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 3000, (n,), generator=g).tolist() for n in (5, 17, 40, 90)]


def run(target, reqs) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, p in enumerate(reqs):
        target.add_request(f"r{i}", p, GREEDY)
    for _ in range(400):
        if not target.has_unfinished():
            break
        for d in target.step():
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
    assert not target.has_unfinished()
    return out


def engine(kv: str, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 64)
    return LLMEngine(model_dir("tiny"), EngineConfig(num_threads=1, kv_cache_dtype=kv, **kw))


@pytest.mark.parametrize("kv", ["fp16", "bf16"])
def test_engine_greedy_equals_the_rounding_reference(kv, monkeypatch):
    """Greedy tokens of the engine (fused C steps, the pool in fp16 / bf16) equal those of the torch
    path with the same pool (torch's own rounding on store, the K/V widened before fp32 attention);
    with fp16 they also equal fp32 KV on the tiny model. The pool is half the fp32 one's bytes."""
    fused = engine(kv)
    assert fused.runner.fused is not None and fused.runner.storage.kv.element_size() == 2
    got = run(fused, prompts())
    monkeypatch.setenv("TRITON_LLM_FUSED_DECODE", "0")
    ref = engine(kv)
    assert ref.runner.fused is None
    assert run(ref, prompts()) == got
    if kv == "fp16":
        monkeypatch.delenv("TRITON_LLM_FUSED_DECODE")
        assert run(engine("auto"), prompts()) == got


def test_handover_moves_half_size_blocks_and_refuses_a_dtype_mismatch():
    """Prefill and decode both fp16: the staged KV is fp16 (half the fp32 bytes) and the stream equals
    a unified fp16 engine's. A decode side with an fp32 pool refuses fp16 KV and recomputes: same
    output as its own unified fp32 engine, never a wrong answer."""
    want16 = run(engine("fp16"), prompts())
    conn = SharedMemoryConnector()
    pair = DisaggPair(engine("fp16"), engine("fp16"), conn)
    assert run(pair, prompts()) == want16
    assert pair.decode_role.stats.admitted == len(prompts()) and pair.decode_role.stats.recomputed == 0
    cfg = pair.decode.runner.config
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    staged_tokens = sum(-(-len(p) // 16) * 16 for p in prompts())
    assert conn.stats().staged_bytes == staged_tokens * per_token

    want32 = run(engine("auto"), prompts())
    pair = DisaggPair(engine("fp16"), engine("auto"), SharedMemoryConnector())
    assert run(pair, prompts()) == want32
    assert pair.decode_role.stats.recomputed == len(prompts())


def test_offload_tier_holds_half_blocks_and_swaps_them_back():
    """The host tier follows the pool's dtype: a prompt evicted from a small fp16 pool comes back from
    the tier (half the fp32 bytes per block) and gives the same tokens as the first time."""
    eng = engine("fp16", num_kv_blocks=12, host_tier_blocks=32)
    tier = eng.kv.offload.tiers[0]
    assert tier.name == "host" and tier.data.dtype == torch.float16
    first = prompts()[3]                                    # 90 tokens: 5 full blocks
    want = run(eng, [first])["r0"]
    run(eng, prompts()[:3] + [list(reversed(first))])       # fill the 12-block pool: `first` evicted
    before = eng.kv.stats()
    assert before.offload_out_blocks >= 5
    assert run(eng, [first])["r0"] == want
    after = eng.kv.stats()
    assert after.offload_in_blocks > before.offload_in_blocks
    cfg = eng.runner.config
    assert after.offload_in_bytes - before.offload_in_bytes == \
        (after.offload_in_blocks - before.offload_in_blocks) * cfg.num_layers * 2 * 16 * cfg.num_kv_heads * cfg.head_dim * 2
