"""Config layouts (transformers 4 and 5), rope scaling, sharded checkpoints, runner sizing."""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from backend.config import EngineConfig
from backend.kv_cache.storage import KVCacheStorage
from backend.model.runner import SeqChunk, build_batch
from backend.model.config import parse_model_config
from backend.model.runner import ModelRunner
from tests.conftest import model_dir

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}   # small, so positions here cross every band


def _base(**kw) -> dict:
    cfg = dict(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256)
    cfg.update(kw)
    return cfg


def copy_with_config(src, dst, edit) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def to_v4(cfg: dict, scaling: dict | None = None) -> None:
    """Rewrite a transformers-5 config.json in place into the transformers-4 key layout."""
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["rope_scaling"] = None if scaling is None else {"rope_type": "llama3", **scaling}
    cfg["torch_dtype"] = cfg.pop("dtype")


def logits_vs_hf(path, n_tokens: int = 40, **args) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    runner = ModelRunner(str(path), EngineConfig(block_size=8, num_kv_blocks=16, **args))
    rng = random.Random(2)
    ids = [rng.randrange(runner.info.vocab_size) for _ in range(n_tokens)]
    table = random.Random(3).sample(range(16), -(-n_tokens // 8))
    ours = runner.execute(build_batch([SeqChunk(ids, 0, table, all_logits=True)], 8))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return ours, hf(torch.tensor([ids])).logits[0]


# --- parsing ---------------------------------------------------------------------------------

def test_v5_and_v4_layouts_parse_alike():
    v5 = parse_model_config(_base(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3},
                                  dtype="bfloat16"))
    v4 = parse_model_config(_base(rope_theta=5e5, rope_scaling={"type": "llama3", **LLAMA3},
                                  torch_dtype="bfloat16"))
    assert v5 == v4
    assert (v5.rope.rope_type, v5.rope.theta, v5.rope.factor, v5.rope.original_max_position_embeddings) == \
        ("llama3", 5e5, 8.0, 64)
    assert v5.dtype == "bfloat16" and v5.head_dim == 16 and v5.num_kv_heads == 4


def test_head_dim_bias_and_eos():
    cfg = parse_model_config(_base(head_dim=32, eos_token_id=[5, 7], attention_bias=True), generation_eos=[9, 5])
    assert cfg.head_dim == 32 and cfg.qkv_bias and cfg.o_bias
    assert cfg.eos_token_ids == [9, 5, 7]
    qwen = parse_model_config(_base(model_type="qwen2", eos_token_id=3, sliding_window=4096))
    assert qwen.qkv_bias and not qwen.o_bias and qwen.eos_token_ids == [3]
    assert qwen.sliding_window is None          # use_sliding_window is off


def test_mistral_sliding_window_caps_context():
    cfg = parse_model_config(_base(model_type="mistral", sliding_window=128, attention_bias=True))
    assert not cfg.qkv_bias and cfg.default_max_model_len() == 128
    assert parse_model_config(_base(model_type="mistral", sliding_window=None)).default_max_model_len() == 256


@pytest.mark.parametrize("bad, match", [({"model_type": "gpt2"}, "model_type"),
                                        ({"hidden_act": "gelu"}, "hidden_act"),
                                        ({"rope_scaling": {"type": "yarn", "factor": 2.0}}, "rope type")])
def test_unsupported_configs_are_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_model_config(_base(**bad))


# --- loading real checkpoints ------------------------------------------------------------------

def test_v4_layout_checkpoint_matches_hf(tmp_path):
    path = copy_with_config(model_dir("tiny"), tmp_path / "v4", to_v4)
    assert "rope_parameters" not in json.loads((path / "config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert ModelRunner(str(path), EngineConfig(num_kv_blocks=2)).info.eos_token_ids == [5, 2]
    ours, ref = logits_vs_hf(path)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_mistral_checkpoint_matches_hf(tmp_path):
    """Mistral's tensors are named like Llama's; its window (longer than this test) changes nothing."""
    def edit(cfg):
        cfg.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=512)
        cfg.pop("attention_bias"), cfg.pop("mlp_bias"), cfg.pop("pretraining_tp")
    path = copy_with_config(model_dir("tiny"), tmp_path / "mistral", edit)
    ours, ref = logits_vs_hf(path)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert ModelRunner(str(path), EngineConfig(num_kv_blocks=2)).info.max_model_len == 512


@pytest.mark.parametrize("layout", ["v4", "v5"])
def test_llama3_rope_scaling_matches_hf(tmp_path, layout):
    def edit(cfg):
        if layout == "v4":
            to_v4(cfg, LLAMA3)
        else:
            cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, **LLAMA3}
    path = copy_with_config(model_dir("tiny"), tmp_path / layout, edit)
    ours, ref = logits_vs_hf(path, n_tokens=120)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    plain, _ = logits_vs_hf(model_dir("tiny"), n_tokens=120)
    assert (plain - ours).abs().max() > 1e-2     # the scaling really changed something


def test_sharded_checkpoint_loads_identically(tmp_path):
    from safetensors.torch import load_file, save_file

    src = model_dir("tiny")
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    state = load_file(str(src / "model.safetensors"))
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, part in halves.items():
        save_file({n: state[n] for n in part}, str(dst / fname), metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}))

    a, b = (ModelRunner(str(p), EngineConfig(num_kv_blocks=4)) for p in (src, dst))
    for (na, pa), (nb, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert na == nb and torch.equal(pa, pb)


def test_runner_sizing_and_info():
    path = model_dir("tiny")
    per_block = KVCacheStorage.bytes_per_block(num_layers=4, block_size=16, num_kv_heads=2, head_dim=64,
                                               dtype=torch.bfloat16)
    r = ModelRunner(str(path), EngineConfig(kv_cache_memory=10 * per_block + 1, dtype="bfloat16", max_model_len=512))
    assert r.num_blocks == 10 and r.storage.k_cache(0).shape == (10, 16, 2, 64)
    assert (r.info.model_type, r.info.num_layers, r.info.num_kv_heads, r.info.head_dim) == ("llama", 4, 2, 64)
    assert r.info.max_model_len == 512 and r.info.eos_token_ids == [2, 0]
    assert ModelRunner(str(path), EngineConfig(num_kv_blocks=3)).info.max_model_len == 1024


@pytest.mark.parametrize("args, match", [(dict(dtype="float64"), "dtype"),
                                         (dict(attention_backend="cuda"), "attention_backend"),
                                         (dict(max_model_len=4096), "max_position_embeddings")])
def test_runner_rejects_bad_options(args, match):
    with pytest.raises(ValueError, match=match):
        ModelRunner(str(model_dir("tiny")), EngineConfig(num_kv_blocks=3, **args))
