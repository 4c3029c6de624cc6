"""Quantization at load (engine option) and GGUF blocks kept quantized, on the tiny presets.

The quality claims on the real model are in docs/quantization.md (load/bench_quant.py: too slow
for make test); here the same kinds of checks run on random-weight presets in seconds.
"""
import json

import pytest
import torch

from backend.config import EngineArgs, EngineConfig
from backend.model.runner import SeqChunk, build_batch
from backend.model.gguf_import import import_gguf
from backend.model.runner import ModelRunner
from backend.quant.plan import planned_summary
from backend.quant.layout import dequantize
from backend.quant.linear import QuantLinear
from tests.conftest import model_dir
from tests.unit.test_gguf_import import write_gguf

PROMPT = [5, 17, 99, 3, 250, 42, 7, 8, 120, 64, 33, 2]


def _logits(runner, ids=PROMPT):
    return runner.execute(build_batch([SeqChunk(ids, 0, list(range(runner.num_blocks)), all_logits=True)], 16))


def _runner(path, **opts):
    return ModelRunner(str(path), EngineConfig(num_kv_blocks=8, **opts))


def test_quantize_at_load_swaps_projections_and_stays_close():
    path = model_dir("tiny")
    ref = _runner(path)
    base = _logits(ref)
    assert ref.model.quantization["method"] == "none"
    for method, tol, kl_max in (("int8", 0.05, 2e-3), ("int4", 0.3, 0.3)):
        r = _runner(path, quantization=method)
        layer = r.model.model.layers[0]
        assert isinstance(layer.self_attn.qkv_proj, QuantLinear) and layer.self_attn.qkv_proj.method == method
        assert not any(isinstance(m, QuantLinear) for m in (r.model.model.embed_tokens,))
        q = r.model.quantization
        assert q["method"] == method and q["weight_bytes"] < ref.model.quantization["weight_bytes"]
        got = _logits(r)
        assert (got - base).abs().max() <= tol * base.abs().max(), method
        kl = torch.nn.functional.kl_div(got.log_softmax(-1), base.log_softmax(-1), log_target=True,
                                        reduction="batchmean")
        assert kl <= kl_max, (method, kl)


def test_quantized_decode_matches_its_own_prefill():
    """Decode rows (C kernel, M = 1) and a prefill (M = 12: also the kernel) give the same logits as
    a long prefill (dequantize + BLAS) on the same quantized weights."""
    r = _runner(model_dir("tiny"), quantization="int4")
    ids = PROMPT * 4                                          # 48 rows: the BLAS path
    full = _logits(r, ids)
    table = list(range(r.num_blocks))
    r.execute(build_batch([SeqChunk(ids[:-1], 0, table)], 16))
    last = r.execute(build_batch([SeqChunk(ids[-1:], len(ids) - 1, table)], 16))
    assert (last[0] - full[-1]).abs().max() <= 1e-4 * full.abs().max()


def test_bad_quantization_options():
    with pytest.raises(ValueError, match="quantization must be"):
        EngineArgs(quantization="int3")
    with pytest.raises(ValueError, match="multiple of 32"):
        _runner(model_dir("tiny"), quantization="int4", quant_group_size=48)
    assert EngineArgs.from_dict({"quantization": "int8", "quant_group_size": "64"}).engine.quant_group_size == 64


@pytest.mark.parametrize("qtype,bits", [("Q8_0", 8), ("Q4_0", 4), ("Q4_1", 4)])
def test_gguf_keep_quantized_runs_at_its_own_size(tmp_path, qtype, bits):
    """tiny-qwen2 (every matrix a multiple of 32 wide, qkv bias, untied head): the packed import
    gives the logits of the dequantized import, in a file a fraction of the size."""
    write_gguf(model_dir("tiny-qwen2"), tmp_path / "m.gguf", qtype=qtype)
    import_gguf(tmp_path / "m.gguf", tmp_path / "f32", progress=None)
    import_gguf(tmp_path / "m.gguf", tmp_path / "packed", progress=None, keep_quantized=True)
    qc = json.loads((tmp_path / "packed" / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "triton_llm", "bits": bits, "group_size": 32, "source": f"gguf:{qtype}"}
    dense, packed = _runner(tmp_path / "f32"), _runner(tmp_path / "packed")
    assert packed.model.quantization["method"] == f"int{bits}"
    assert planned_summary(tmp_path / "packed", dtype=torch.float32) == packed.model.quantization   # /v1/models
    a, b = _logits(dense), _logits(packed)
    assert (a - b).abs().max() <= 1e-4 * a.abs().max()
    proj = lambda r: sum(p.numel() * p.element_size() for n, p in r.model.named_parameters() if "_proj" in n)  # noqa: E731
    assert proj(packed) <= (0.3 if bits == 8 else 0.2) * proj(dense)
    with pytest.raises(ValueError, match="already quantized"):
        _runner(tmp_path / "packed", quantization="int8" if bits == 4 else "int4")
    assert _runner(tmp_path / "packed", quantization=f"int{bits}").model.quantization["method"] == f"int{bits}"
    if bits == 8:                 # quant_lm_head: the head on the file's own Q8_0 groups, its bytes
        head = _runner(tmp_path / "packed", quant_lm_head=True)
        hq = head.model.lm_head_q
        assert hq.method == "int8" and hq.group_size == 32
        assert torch.equal(dequantize(hq.quant_weight()), dense.model.lm_head_weight().data.float())
        assert planned_summary(tmp_path / "packed", dtype=torch.float32, lm_head=True) == head.model.quantization


def test_gguf_keep_quantized_requantizes_unmapped_projections(tmp_path):
    """tiny's down_proj (688 wide) stays F32 in the GGUF: it is quantized to the file's layout."""
    write_gguf(model_dir("tiny"), tmp_path / "m.gguf", qtype="Q4_0")
    import_gguf(tmp_path / "m.gguf", tmp_path / "f32", progress=None)
    import_gguf(tmp_path / "m.gguf", tmp_path / "packed", progress=None, keep_quantized=True)
    dense, packed = _runner(tmp_path / "f32"), _runner(tmp_path / "packed")
    assert packed.model.model.layers[0].mlp.down_proj.method == "int4"
    a, b = _logits(dense), _logits(packed)
    assert (a - b).abs().max() <= 0.15 * a.abs().max()


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2"])
def test_int16_activations_stay_close_to_weight_only(preset):
    """int8 per channel: GEMMs of at least A16_MIN_M rows quantize activations to int16 (the default,
    backend/quant/cpu.py). The stated bound on the model: logits within 1e-3 of max |logits| of the
    weight-only (fp32-activation) reference on the same int8 weights, and the same greedy token
    wherever the reference's top-2 margin exceeds twice that difference."""
    from backend.quant import cpu

    lib = cpu.library()
    if lib is None:
        pytest.skip("no C compiler: torch fallback only")
    r = _runner(model_dir(preset), quantization="int8")
    ids = PROMPT * 4                                          # 48 rows: every GEMM on the int16 kernel
    try:
        lib.w8_set_a16_min_m(0)
        ref = _logits(r, ids)
    finally:
        lib.w8_set_a16_min_m(cpu.A16_MIN_M)
    got = _logits(r, ids)
    diff = (got - ref).abs().max()
    assert 0 < diff <= 1e-3 * ref.abs().max()
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * diff
    assert clear.sum() >= len(ids) // 2
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])
