"""``/v1/embeddings`` through the whole stack -- the official ``openai`` SDK -> shim -> tritonserver
(preprocessing, engine) -> the scheduler -- against transformers' pooled hidden states (fp32, 1e-4):
text, token ids, float and base64, a 64-input batch equal to one by one, bad (and fuzzed) input as OpenAI 4xx
that disturb nothing, KV idle afterwards, and streamed generations unchanged by embeddings beside them."""
from __future__ import annotations

import asyncio
import base64
import functools

import httpx
import numpy as np
import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.shim_fixtures import KEY, MODEL, async_sdk, sdk, shim, wait_metric  # noqa: F401 -- fixtures

pytestmark = pytest.mark.e2e

TEXTS = ["Hello, world!", "你好，世界！今天天气怎么样？", "Emoji 😀🎉🚀 and naïve café",
         "a longer input " * 40, "x"]


@functools.lru_cache(maxsize=None)
def hf(model_dir: str):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, PreTrainedTokenizerFast.from_pretrained(model_dir)


def reference(model_dir, ids: list[int]) -> np.ndarray:
    """transformers' final-normed hidden state of the last token, L2-normalized (the default)."""
    model, _ = hf(str(model_dir))
    with torch.inference_mode():
        h = model.model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(h, dim=0).numpy()


def ids_of(model_dir, text: str) -> list[int]:
    return hf(str(model_dir))[1].backend_tokenizer.encode(text).ids     # what preprocessing does


def kv_idle(shim) -> None:
    assert wait_metric(shim.metrics_url, "llm_kv_cache_usage_ratio", lambda v: v == 0) == 0
    assert wait_metric(shim.metrics_url, "llm_num_requests_running", lambda v: v == 0) == 0


def test_text_batch_equals_transformers_float_and_base64(sdk, shim, triton_server):
    got = sdk.embeddings.create(model=MODEL, input=TEXTS)            # the SDK asks for base64
    as_float = sdk.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    ids = [ids_of(triton_server.model_dir, t) for t in TEXTS]
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, ids))
    assert [d.index for d in got.data] == list(range(len(TEXTS)))
    for d, f, toks in zip(got.data, as_float.data, ids):
        want = reference(triton_server.model_dir, toks)
        np.testing.assert_allclose(np.array(d.embedding), want, atol=1e-4, rtol=0)
        # two requests: their steps may batch differently (a GEMM row's rounding depends on the rows beside it)
        np.testing.assert_allclose(f.embedding, d.embedding, atol=1e-6, rtol=0)
    kv_idle(shim)


def test_token_id_inputs(sdk, triton_server):
    one = [5, 17, 300, 2000, 7]
    single = sdk.embeddings.create(model=MODEL, input=one, encoding_format="float")
    many = sdk.embeddings.create(model=MODEL, input=[one, [9] * 30], encoding_format="float")
    assert single.usage.prompt_tokens == 5 and many.usage.prompt_tokens == 35
    np.testing.assert_allclose(single.data[0].embedding, reference(triton_server.model_dir, one), atol=1e-4, rtol=0)
    np.testing.assert_allclose(many.data[1].embedding, reference(triton_server.model_dir, [9] * 30), atol=1e-4,
                               rtol=0)
    raw = httpx.post(f"{sdk.base_url}embeddings", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                     json={"model": MODEL, "input": one, "encoding_format": "base64"}).json()
    assert raw["object"] == "list" and raw["data"][0]["object"] == "embedding" and raw["model"] == MODEL
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(vec, np.array(single.data[0].embedding, dtype=np.float32))


def test_batch_of_64_equals_one_by_one(async_sdk, shim):
    rng = np.random.default_rng(0)
    inputs = [rng.integers(3, 3000, size=int(n)).tolist() for n in rng.integers(1, 300, size=64)]

    async def run():
        batched = await async_sdk.embeddings.create(model=MODEL, input=inputs, encoding_format="float")
        alone = [await async_sdk.embeddings.create(model=MODEL, input=x, encoding_format="float") for x in inputs]
        return batched, alone

    batched, alone = asyncio.run(run())
    assert batched.usage.prompt_tokens == sum(map(len, inputs))
    for d, a in zip(batched.data, alone):
        np.testing.assert_allclose(d.embedding, a.data[0].embedding, atol=1e-5, rtol=0)
    kv_idle(shim)


BAD = [
    ({"input": 5}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": [True, 2]}, "input"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [-3]}, "input"),
    ({"input": [5] * 1025}, "input"),                 # past the 1,024-token context window
    ({"input": "many words " * 700}, "input"),        # text past it
    ({"input": [3, 99999]}, "input"),                 # not in the vocabulary
    ({"input": "hi", "encoding_format": "binary"}, "encoding_format"),
    ({"input": "hi", "dimensions": 64}, "dimensions"),  # the tiny model declares no Matryoshka
    ({"input": "hi", "dimensions": "64"}, "dimensions"),
]


@pytest.mark.parametrize("body, param", BAD, ids=[f"{i}-{p}" for i, (_, p) in enumerate(BAD)])
def test_bad_input_is_an_openai_400(sdk, shim, body, param):
    r = httpx.post(f"{shim.url}/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                   json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    ok = sdk.embeddings.create(model=MODEL, input="still fine", encoding_format="float")
    assert len(ok.data[0].embedding) == 256
    kv_idle(shim)


def test_sdk_raises_bad_request_and_unknown_model_is_404(sdk):
    with pytest.raises(openai.BadRequestError) as exc:
        sdk.embeddings.create(model=MODEL, input="hi", dimensions=32)
    assert exc.value.body["param"] == "dimensions"
    with pytest.raises(openai.NotFoundError):
        sdk.embeddings.create(model="nope", input="hi")


def test_streamed_generations_unchanged_by_embeddings(async_sdk, shim):
    """Four greedy streams alone, then again with embedding batches sent once every stream has
    its first chunk (so they run while those streams decode): the same text."""
    prompts = ["Once upon a time", "The weather today", "数字: 1, 2, 3", "In a galaxy far away"]
    extra = {"ignore_eos": True}
    emb_inputs = [[7 + i] * (40 + 37 * i) for i in range(16)]

    async def stream(prompt, started: asyncio.Event | None = None) -> str:
        out = []
        s = await async_sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=64, temperature=0.0,
                                               stream=True, extra_body=extra)
        async for chunk in s:
            out.append(chunk.choices[0].text if chunk.choices else "")
            if started is not None and not started.is_set():
                started.set()
        return "".join(out)

    async def run():
        alone = await asyncio.gather(*(stream(p) for p in prompts))
        events = [asyncio.Event() for _ in prompts]
        streams = [asyncio.ensure_future(stream(p, e)) for p, e in zip(prompts, events)]
        await asyncio.gather(*(e.wait() for e in events))
        embeds = await asyncio.gather(*(async_sdk.embeddings.create(model=MODEL, input=emb_inputs[i::4],
                                                                   encoding_format="float") for i in range(4)))
        return alone, await asyncio.gather(*streams), embeds

    alone, beside, embeds = asyncio.run(run())
    assert beside == alone
    assert all(len(r.data) == 4 for r in embeds)
    kv_idle(shim)


junk = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
                 st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
                 st.lists(st.integers(min_value=-5, max_value=4000), max_size=4),
                 st.lists(st.one_of(st.text(max_size=4), st.integers(), st.lists(st.integers(), max_size=2)), max_size=3),
                 st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


@settings(max_examples=60, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(field=st.sampled_from(["input", "encoding_format", "dimensions", "normalize", "model"]), value=junk)
def test_fuzzed_fields_get_a_4xx_or_a_vector(shim, field, value):
    body = {"model": MODEL, "input": [3, 4, 5], field: value}
    r = httpx.post(f"{shim.url}/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"}, json=body, timeout=60)
    if r.status_code == 200:
        assert len(r.json()["data"]) >= 1
    else:
        assert r.status_code in (400, 404), r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_engine_idle_after_the_fuzz(shim):
    kv_idle(shim)
