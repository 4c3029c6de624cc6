"""``triton-llm serve --lora NAME=DIR``: the adapter is registered with the engine at start and the
shim serves it under its name (listed with its parent, answering like the offline engine)."""
from __future__ import annotations

import signal

import openai
import pytest

from backend import LLM, SamplingParams
from client.shim.background import free_port
from tests.conftest import model_dir
from tests.e2e.helpers import reap_serve, start_serve
from tests.unit.lora_helpers import make_adapter

pytestmark = pytest.mark.e2e


def test_serve_lora(tmp_path):
    tiny = model_dir("tiny")
    adapter = str(make_adapter(tiny, tmp_path / "ad", 8, 16, ["q_proj", "gate_proj"], 51))
    want = LLM(str(tiny), num_kv_blocks=64, max_loras=1, lora_modules={"ad": adapter}).generate(
        ["Once upon a time"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, lora="ad"))[0].outputs[0].text
    shim, workdir = free_port(), tmp_path / "serve"
    proc, _ = start_serve(["--model", str(tiny), "--http-port", str(free_port()), "--grpc-port", str(free_port()),
                           "--metrics-port", str(free_port()), "--shim-port", str(shim), "--workdir", str(workdir),
                           "--engine-option", "num_kv_blocks=64", "--engine-option", "num_threads=1",
                           "--engine-option", "dtype=float32",           # the offline oracle's (serve: auto)
                           "--lora", f"ad={adapter}"], timeout=180)
    try:
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{shim}/v1", api_key="none", max_retries=0, timeout=120)
        cards = {m.id: m for m in sdk.models.list().data}
        assert cards["ad"].parent == "tiny" and set(cards) == {"tiny", "ad"}
        got = sdk.completions.create(model="ad", prompt="Once upon a time", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
        assert got == want
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        reap_serve(proc, workdir)
