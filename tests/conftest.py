"""Shared fixtures: checkpoints made once per machine (cached under build/models)."""
from __future__ import annotations

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL_CACHE = ROOT / "build" / "models"


def model_dir(preset: str) -> pathlib.Path:
    """A checkpoint directory for a preset, made on first use (seed 0)."""
    from backend.make_model import make_model

    out = MODEL_CACHE / preset
    if not (out / "model.safetensors").exists():
        tmp = MODEL_CACHE / f".{preset}.tmp"
        make_model(preset, tmp)
        tmp.rename(out)
    return out


@pytest.fixture(scope="session")
def tiny_model() -> pathlib.Path:
    return model_dir("tiny")


@pytest.fixture(scope="session")
def tiny_qwen2_model() -> pathlib.Path:
    return model_dir("tiny-qwen2")
