"""The lora_admin control request's parsing (backend/serving/lora_control.py) and the keys-file
option that allows the admin routes (client/shim/tenants.py)."""
from __future__ import annotations

import json

import pytest

from backend.errors import EngineError
from backend.serving.lora_control import parse_command, registry_of
from client.shim.tenants import parse_key_entry


def test_parse_command():
    assert parse_command(json.dumps({"action": "load", "lora_name": "a", "lora_path": "/d"})) == ("load", "a", "/d")
    assert parse_command({"action": "unload", "lora_name": "a"}) == ("unload", "a", None)
    for raw, param in [("{", "lora_admin"), ("[]", "lora_admin"), ('{"action": "x", "lora_name": "a"}', "action"),
                       ('{"action": "load", "lora_name": ""}', "lora_name"),
                       ('{"action": "load", "lora_name": "a"}', "lora_path")]:
        with pytest.raises(EngineError) as err:
            parse_command(raw)
        assert err.value.param == param, raw


def test_registry_of_a_loop_without_lora():
    assert registry_of(object()) is None


def test_admin_key_option():
    assert parse_key_entry("sk-1:ops admin=1")[1].admin is True
    assert parse_key_entry("sk-2:acme")[1].admin is False
    with pytest.raises(ValueError, match="admin must be 0 or 1"):
        parse_key_entry("sk-3 admin=2")


def test_warm_reloads_an_evicted_adapter_before_the_engine(tiny_model, tmp_path):
    from types import SimpleNamespace

    from backend.lora import LoRARegistry
    from backend.model.config import load_model_config
    from backend.serving.lora_control import warm
    from tests.unit.lora_helpers import make_adapter

    path = str(make_adapter(tiny_model, tmp_path / "a", 8, 16, ["q_proj"], 71))
    reg = LoRARegistry(load_model_config(str(tiny_model)), max_loras=1, max_lora_rank=64)
    reg.load("a", path)
    reg.load("b", path)                                  # evicts a
    loop = SimpleNamespace(engine=SimpleNamespace(runner=SimpleNamespace(loras=reg)))
    warm(loop, "a")
    assert reg.resident() == ["a"] and reg.loads == 3
    with pytest.raises(EngineError) as err:
        warm(loop, "zz")
    assert err.value.param == "lora" and "unknown LoRA adapter 'zz'" in err.value.message
