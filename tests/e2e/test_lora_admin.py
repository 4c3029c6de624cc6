"""LoRA through the OpenAI shim and tritonserver, with the official SDK: the ``model`` field picks
an adapter, /v1/models lists adapters with their parent, the admin routes load and unload adapters
at run time (admin keys only), a bad adapter is a 400 naming the field, and a request naming an
unloaded adapter is a 404 in OpenAI's error shape while a stream on it finishes unchanged."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest

from backend import LLM, SamplingParams
from client.shim.background import free_port
from tests.conftest import model_dir
from tests.e2e.shim_fixtures import stop_shim
from tests.unit.lora_helpers import make_adapter
from backend.serving.process_group import wait_http_ok

pytestmark = pytest.mark.e2e

ADMIN, USER = "sk-lora-admin", "sk-lora-user"
PROMPT = "Once upon a time"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root, tiny = tmp_path_factory.mktemp("loras"), model_dir("tiny")
    return {"a": str(make_adapter(tiny, root / "a", 8, 16, ["q_proj", "v_proj"], 41)),
            "b": str(make_adapter(tiny, root / "b", 16, 16, ["o_proj", "down_proj"], 42)),
            "big": str(make_adapter(tiny, root / "big", 32, 16, ["q_proj"], 43))}


@pytest.fixture(scope="module")
def offline(adapters):
    llm = LLM(str(model_dir("tiny")), num_kv_blocks=64, max_loras=2, max_lora_rank=16,
              lora_modules={k: adapters[k] for k in ("a", "b")})
    sp = {r: SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, lora=r) for r in ("a", "b", None)}
    return {r: llm.generate([PROMPT], p)[0].outputs[0].text for r, p in sp.items()}


@pytest.fixture(scope="module")
def shim_url(adapters, tmp_path_factory):
    from backend.serving.launcher import TritonServer

    tmp = tmp_path_factory.mktemp("shim")
    opts = {"num_kv_blocks": "64", "block_size": "16", "num_threads": "1", "max_loras": "2",
            "max_lora_rank": "16", "lora_modules": json.dumps({"a": adapters["a"]})}
    with TritonServer(model_dir("tiny"), engine_options=opts, quiet=True) as server:
        (tmp / "keys.txt").write_text(f"{ADMIN}:ops admin=1\n{USER}:acme\n")
        port = free_port()
        log = open(tmp / "shim.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "client.shim", "--triton-grpc", server.grpc_url,
                                 "--host", "127.0.0.1", "--port", str(port), "--api-keys", str(tmp / "keys.txt"),
                                 "--model-dir", str(server.model_dir), "--model-name", "tiny",
                                 "--lora-name", "a"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            assert wait_http_ok(url + "/health", proc, 180), (tmp / "shim.log").read_text()[-3000:]
            yield url
        finally:
            stop_shim(proc)
            log.close()


def sdk(url: str, key: str = USER) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def complete(url: str, model: str) -> str:
    return sdk(url).completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text


def admin(url: str, route: str, body: dict, key: str = ADMIN) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def test_models_and_adapter_generation(shim_url, offline):
    cards = {m.id: m for m in sdk(shim_url).models.list().data}
    assert set(cards) == {"tiny", "a"} and cards["a"].parent == "tiny"
    assert complete(shim_url, "a") == offline["a"] and complete(shim_url, "tiny") == offline[None]
    assert offline["a"] != offline[None]
    with pytest.raises(openai.NotFoundError) as err:
        complete(shim_url, "b")
    assert err.value.code == "model_not_found"


def test_admin_load_unload(shim_url, adapters, offline):
    r = admin(shim_url, "load_lora_adapter", {"lora_name": "b", "lora_path": adapters["b"]}, key=USER)
    assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_permissions"
    r = admin(shim_url, "load_lora_adapter", {"lora_name": "big", "lora_path": adapters["big"]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "lora_path" and "exceeds max_lora_rank=16" in r.json()["error"]["message"]
    r = admin(shim_url, "load_lora_adapter", {"lora_name": "b", "lora_path": adapters["b"]})
    assert r.status_code == 200, r.text
    assert complete(shim_url, "b") == offline["b"] != offline[None]
    r = admin(shim_url, "load_lora_adapter", {"lora_name": "b", "lora_path": adapters["b"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    assert {m.id for m in sdk(shim_url).models.list().data} == {"tiny", "a", "b"}

    stream = sdk(shim_url).completions.create(model="a", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    assert admin(shim_url, "unload_lora_adapter", {"lora_name": "a"}).status_code == 200
    text += "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline["a"]                     # the stream that started on it is unchanged
    with pytest.raises(openai.NotFoundError):
        complete(shim_url, "a")
    r = admin(shim_url, "unload_lora_adapter", {"lora_name": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert complete(shim_url, "tiny") == offline[None] and complete(shim_url, "b") == offline["b"]
