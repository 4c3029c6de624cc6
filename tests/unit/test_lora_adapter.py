"""PEFT adapter loading and validation (backend/lora/adapter.py) and the bounded registry."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.lora import LoRAError, LoRARegistry, load_adapter
from backend.lora.registry import UnknownAdapter, parse_lora_modules
from backend.model.config import load_model_config
from tests.unit.lora_helpers import make_adapter


@pytest.fixture(scope="module")
def cfg(tiny_model):
    return load_model_config(str(tiny_model))


@pytest.fixture(scope="module")
def good(tiny_model, tmp_path_factory):
    return make_adapter(tiny_model, tmp_path_factory.mktemp("good") / "a", 8, 16, ["q_proj", "down_proj"], 5)


def variant(good, tmp_path, config=None, tensors=None):
    d = tmp_path / "v"
    shutil.copytree(good, d)
    if config is not None:
        c = json.loads((d / "adapter_config.json").read_text())
        c.update(config)
        (d / "adapter_config.json").write_text(json.dumps(c))
    if tensors is not None:
        t = load_file(d / "adapter_model.safetensors")
        tensors(t)
        save_file(t, d / "adapter_model.safetensors")
    return d


def test_loads_shapes_and_scale(good, cfg):
    a = load_adapter("a", good, cfg, max_rank=64)
    assert a.rank == 8 and a.scale == 2.0 and a.uid.startswith("a@")
    assert sorted(a.layers[0]) == ["down_proj", "q_proj"] and all(len(layer) == 2 for layer in a.layers)
    A, B = a.layers[1]["down_proj"]
    assert A.shape == (8, cfg.intermediate_size) and B.shape == (cfg.hidden_size, 8)
    assert bool(B.abs().sum() > 0)


def test_rank_over_max(good, cfg):
    with pytest.raises(LoRAError, match=r"adapter_config.json: field r=8 exceeds max_lora_rank=4"):
        load_adapter("a", good, cfg, max_rank=4)


def test_mismatched_shape(good, cfg, tmp_path):
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"

    def cut(t):
        t[key] = t[key][:-1].contiguous()
    with pytest.raises(LoRAError, match=r"adapter_model.safetensors: tensor .*q_proj.lora_B.weight.* has shape "
                                        r"\[255, 8\], the base model needs \[256, 8\]"):
        load_adapter("a", variant(good, tmp_path, tensors=cut), cfg, max_rank=64)


def test_untargeted_and_missing_tensors(good, cfg, tmp_path):
    with pytest.raises(LoRAError, match=r"targets self_attn.q_proj, not in target_modules \['down_proj'\]"):
        load_adapter("a", variant(good, tmp_path, config={"target_modules": ["down_proj"]}), cfg, max_rank=64)
    shutil.rmtree(tmp_path / "v")
    with pytest.raises(LoRAError, match=r"layer 2 down_proj has no lora_B tensor"):
        load_adapter("a", variant(good, tmp_path, tensors=lambda t: t.pop(
            "base_model.model.model.layers.2.mlp.down_proj.lora_B.weight")), cfg, max_rank=64)


def test_corrupt_files(good, cfg, tmp_path):
    d = variant(good, tmp_path)
    (d / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(LoRAError, match=r"adapter_model.safetensors: not a readable safetensors file"):
        load_adapter("a", d, cfg, max_rank=64)
    (d / "adapter_config.json").write_text("{")
    with pytest.raises(LoRAError, match=r"adapter_config.json: not readable JSON"):
        load_adapter("a", d, cfg, max_rank=64)
    with pytest.raises(LoRAError, match=r"not a directory"):
        load_adapter("a", tmp_path / "nowhere", cfg, max_rank=64)


@pytest.mark.parametrize("field,value,msg", [
    ("target_modules", ["lm_head"], r"target_modules names \['lm_head'\]"),
    ("use_dora", True, r"use_dora=True is not supported"),
    ("r", 0, r"field r must be a positive integer"),
    ("lora_alpha", "x", r"lora_alpha must be a number"),
])
def test_bad_config_fields(good, cfg, tmp_path, field, value, msg):
    with pytest.raises(LoRAError, match=msg):
        load_adapter("a", variant(good, tmp_path, config={field: value}), cfg, max_rank=64)


def test_registry_lru_evicts_idle_only(good, cfg):
    reg = LoRARegistry(cfg, max_loras=2, max_lora_rank=64)
    a = reg.load("a", str(good))
    reg.load("b", str(good))
    assert reg.resolve("a") is a and reg.resident() == ["b", "a"]
    reg.load("c", str(good))                       # b is the least recently used and idle
    assert reg.resident() == ["a", "c"] and reg.evictions == 1 and reg.names() == ["a", "b", "c"]
    b = reg.resolve("b", busy={"a"})               # reloaded; a is busy, so c goes
    assert reg.resident() == ["a", "b"] and b.uid == a.uid.replace("a@", "b@")
    with pytest.raises(LoRAError, match=r"all 2 adapter slots"):
        reg.resolve("c", busy={"a", "b"})
    assert reg.resident() == ["a", "b"]            # nothing disturbed
    reg.unload("a")
    with pytest.raises(UnknownAdapter):
        reg.resolve("a")
    with pytest.raises(LoRAError, match="already loaded"):
        reg.load("b", str(good))
    assert a.layers[0]["q_proj"][0].shape == (8, cfg.hidden_size)   # a holder keeps its weights


def test_bad_load_changes_nothing(good, cfg, tmp_path):
    reg = LoRARegistry(cfg, max_loras=1, max_lora_rank=64)
    reg.load("a", str(good))
    with pytest.raises(LoRAError):
        reg.load("bad", str(variant(good, tmp_path, config={"r": 128})))
    assert reg.resident() == ["a"] and reg.names() == ["a"]


def test_lora_modules_option():
    assert parse_lora_modules('{"x": "/d"}') == {"x": "/d"} and parse_lora_modules(None) == {}
    with pytest.raises(ValueError, match="lora_modules must be a JSON object"):
        parse_lora_modules('["x"]')


def test_dtype_and_finite(good, cfg, tmp_path):
    a = load_adapter("a", good, cfg, max_rank=64, dtype=torch.bfloat16)
    assert a.layers[0]["q_proj"][1].dtype == torch.bfloat16
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"

    def nan(t):
        t[key][0, 0] = float("nan")
    with pytest.raises(LoRAError, match="finite"):
        load_adapter("a", variant(good, tmp_path, tensors=nan), cfg, max_rank=64)
