"""common/env.py: one boolean dialect, registered names only, clear errors for bad values."""
from __future__ import annotations

import pytest

from common import env


@pytest.mark.parametrize("text,want", [("1", True), ("on", True), (" YES ", True), ("true", True),
                                       ("0", False), ("off", False), ("No", False), ("false", False)])
def test_one_boolean_dialect(text, want):
    assert env.parse_bool(text) is want


def test_a_bad_boolean_names_the_variable(monkeypatch):
    monkeypatch.setenv("TRITON_LLM_HUGE_PAGES", "maybe")
    with pytest.raises(ValueError, match="TRITON_LLM_HUGE_PAGES must be one of"):
        env.flag("TRITON_LLM_HUGE_PAGES")


def test_defaults_and_values(monkeypatch):
    monkeypatch.delenv("TRITON_LLM_FUSED_DECODE", raising=False)
    assert env.flag("TRITON_LLM_FUSED_DECODE") is True
    monkeypatch.setenv("TRITON_LLM_FUSED_DECODE", "0")
    assert env.flag("TRITON_LLM_FUSED_DECODE") is False
    monkeypatch.delenv("TRITON_LLM_FUSED_MAX_TOKENS", raising=False)
    assert env.integer("TRITON_LLM_FUSED_MAX_TOKENS", 7) == 7
    monkeypatch.setenv("TRITON_LLM_FUSED_MAX_TOKENS", "x")
    with pytest.raises(ValueError, match="TRITON_LLM_FUSED_MAX_TOKENS must be an integer"):
        env.integer("TRITON_LLM_FUSED_MAX_TOKENS", 7)


def test_an_unregistered_name_is_a_bug():
    with pytest.raises(KeyError):
        env.raw("TRITON_LLM_NOT_A_VARIABLE")


def test_update_sets_and_unsets(monkeypatch):
    monkeypatch.delenv("TRITON_LLM_ENGINE_NICE", raising=False)
    env.update({"TRITON_LLM_ENGINE_NICE": "5"})
    assert env.raw("TRITON_LLM_ENGINE_NICE") == "5" and env.snapshot()["TRITON_LLM_ENGINE_NICE"] == "5"
    env.update({"TRITON_LLM_ENGINE_NICE": None})
    assert env.raw("TRITON_LLM_ENGINE_NICE") is None
