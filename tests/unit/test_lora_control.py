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
