"""The OpenAI shim in front of a real tritonserver, driven by the official ``openai`` SDK."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from backend.config import EngineArgs
from backend.engine.admission import SamplingParams
from tests.conftest import E2E_ENGINE_OPTIONS
from tests.e2e.shim_fixtures import KEY, MODEL, async_sdk, sdk, shim  # noqa: F401 -- fixtures

pytestmark = pytest.mark.e2e

CHAT = [{"role": "user", "content": "Tell me a story about 小猫 and 🐉."}]
GREEDY = {"temperature": 0.0}


def chat_text(r) -> str:
    return r.choices[0].message.content


@pytest.fixture(scope="module")
def offline(triton_server):
    """The backend's offline LLM on the served checkpoint and engine options: the reference."""
    from backend.llm import LLM

    return LLM(str(triton_server.model_dir), **EngineArgs.from_dict(E2E_ENGINE_OPTIONS).options())


def offline_chat(llm, messages, **params):
    """Greedy offline answer to chat ``messages`` (the same chat template the server applies)."""
    ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    return llm.generate([list(ids)], SamplingParams(temperature=0.0, **params))[0]


def offline_texts(llm, prompts, **params) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(list(prompts), SamplingParams(temperature=0.0, **params))]


def test_chat_non_streaming_equals_offline(sdk, offline):
    raw = sdk.chat.completions.with_raw_response.create(model=MODEL, messages=CHAT, max_tokens=12, **GREEDY)
    r = raw.parse()
    want = offline_chat(offline, CHAT, max_tokens=12)
    assert r.object == "chat.completion" and r.model == MODEL and len(r.choices) == 1
    assert r.choices[0].message.role == "assistant"
    assert chat_text(r) == want.outputs[0].text
    assert r.choices[0].finish_reason == want.outputs[0].finish_reason
    assert r.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached % 16 == 0 and cached < r.usage.prompt_tokens           # whole blocks, never the whole prompt
    extra = r.model_extra["triton_llm"]
    h = raw.headers                                                      # the headers repeat the body's numbers
    assert h["x-request-id"] == r.id and int(h["x-triton-llm-cached-tokens"]) == cached
    assert float(h["x-triton-llm-queue-time"]) == pytest.approx(extra["queue_time"], abs=1e-3)
    assert float(h["x-triton-llm-e2e"]) == pytest.approx(extra["e2e"], abs=1e-3)
    assert 0 <= extra["queue_time"] < extra["e2e"]                      # ttft: streaming only
    assert int(h["x-triton-llm-preemptions"]) == 0


def test_chat_streaming_equals_non_streaming_and_include_usage(sdk):
    whole = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, **GREEDY)
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_text(whole)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == whole.usage.completion_tokens
    assert usage.usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.usage.prompt_tokens_details.cached_tokens > 0     # the same prompt again: cached
    assert usage.model_extra["triton_llm"]["ttft"] is not None


def test_completions_streaming_and_not(sdk, offline):
    prompt = "Once upon a time"
    whole = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=16, **GREEDY)
    (want,) = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))
    assert whole.object == "text_completion" and whole.choices[0].text == want.outputs[0].text
    assert whole.choices[0].finish_reason == want.outputs[0].finish_reason
    streamed = "".join(c.choices[0].text for c in sdk.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, stream=True, **GREEDY) if c.choices)
    assert streamed == whole.choices[0].text


def test_max_tokens_gives_length(sdk):
    r = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=5,
                                    extra_body={"ignore_eos": True}, **GREEDY)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    r = sdk.completions.create(model=MODEL, prompt="abc", max_tokens=3, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_stop_string_trims_and_finishes_with_stop(sdk):
    base = sdk.completions.create(model=MODEL, prompt="The sea", max_tokens=40,
                                  extra_body={"ignore_eos": True}, **GREEDY).choices[0].text
    assert len(base) > 12
    stop = base[8:11]
    assert stop.strip(), f"pick another stop string from {base!r}"
    expected = base[:base.index(stop)]
    for stream in (False, True):
        r = sdk.completions.create(model=MODEL, prompt="The sea", max_tokens=40, stop=[stop, "\x00never"],
                                   stream=stream, extra_body={"ignore_eos": True}, **GREEDY)
        if stream:
            parts = list(r)
            text = "".join(c.choices[0].text for c in parts if c.choices)
            finish = [c.choices[0].finish_reason for c in parts if c.choices and c.choices[0].finish_reason]
        else:
            text, finish = r.choices[0].text, [r.choices[0].finish_reason]
        assert (text, finish) == (expected, ["stop"])


def test_n2_streaming(sdk):
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=CHAT, n=2, max_tokens=8, stream=True,
                                              temperature=1.0, seed=7, extra_body={"ignore_eos": True}))
    texts, finishes, roles = {0: "", 1: ""}, {}, set()
    for c in chunks:
        for ch in c.choices:
            roles.update([ch.index] if ch.delta.role else [])
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert roles == {0, 1} and finishes == {0: "length", 1: "length"}
    assert texts[0] and texts[1]
    whole = sdk.chat.completions.create(model=MODEL, messages=CHAT, n=2, max_tokens=8, temperature=1.0,
                                        seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in whole.choices] == [0, 1] and whole.usage.completion_tokens == 16


def test_seeded_sampling_is_repeatable(sdk):
    def once(seed):
        return sdk.completions.create(model=MODEL, prompt="Random words:", max_tokens=16, temperature=1.0,
                                      top_p=0.95, seed=seed, extra_body={"top_k": 50, "min_p": 0.01,
                                                                         "ignore_eos": True}).choices[0].text
    a, b, c = once(1234), once(1234), once(99)
    assert a == b and a != c


def test_penalties_reach_the_sampler(sdk, offline):
    """Greedy with penalties equals the offline answer with the same penalties and differs from
    the plain greedy one (the tiny model repeats itself, so the penalties change its answer)."""
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2}
    r = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, presence_penalty=0.5,
                                    frequency_penalty=0.5, extra_body={"repetition_penalty": 1.2,
                                                                       "ignore_eos": True}, **GREEDY)
    want = offline_chat(offline, CHAT, max_tokens=16, ignore_eos=True, **penalties).outputs[0].text
    plain = offline_chat(offline, CHAT, max_tokens=16, ignore_eos=True).outputs[0].text
    assert chat_text(r) == want and want != plain


def test_logprobs_shapes(sdk, offline):
    from backend.serving.postprocess import TokenBytes

    r = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, logprobs=True, top_logprobs=2,
                                    extra_body={"ignore_eos": True}, **GREEDY)
    content = r.choices[0].logprobs.content
    want = offline_chat(offline, CHAT, max_tokens=4, ignore_eos=True).outputs[0].token_ids
    token_bytes = TokenBytes(offline.tokenizer)
    assert [bytes(t.bytes) for t in content] == [token_bytes(i) for i in want]     # the greedy tokens
    for t in content:
        assert t.token == bytes(t.bytes).decode("utf-8", errors="replace") and t.logprob <= 0
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-4)   # greedy: the best one
    c = sdk.completions.create(model=MODEL, prompt="Hello", max_tokens=3, logprobs=1,
                               extra_body={"ignore_eos": True}, **GREEDY)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3
    assert lp.text_offset[0] == 0 and all(len(d) == 1 for d in lp.top_logprobs)


def test_unknown_fields_are_ignored(sdk):
    plain = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, **GREEDY)
    r = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, **GREEDY,
                                    extra_body={"not_an_openai_field": {"x": [1, 2]}, "guided_json": None})
    assert chat_text(r) == chat_text(plain) and r.usage.completion_tokens == plain.usage.completion_tokens


def test_models_and_health(sdk, shim):
    assert [m.id for m in sdk.models.list().data] == [MODEL]
    assert sdk.models.retrieve(MODEL).model_extra["max_model_len"] == 1024
    assert httpx.get(shim.url + "/health").status_code == 200
    assert httpx.get(shim.url + "/ready").json() == {"status": "ready"}


def test_32_concurrent_streams_equal_their_non_streamed_and_offline_results(async_sdk, offline):
    prompts = [f"Story number {i}: the {['cat', '猫', 'dragon 🐉', 'ship'][i % 4]}" for i in range(32)]

    async def one(p):
        whole = await async_sdk.completions.create(model=MODEL, prompt=p, max_tokens=16, **GREEDY)
        return whole.choices[0].text

    async def streamed(p):
        text = ""
        async for c in await async_sdk.completions.create(model=MODEL, prompt=p, max_tokens=16, stream=True,
                                                          **GREEDY):
            text += c.choices[0].text if c.choices else ""
        return text

    async def go():
        s = await asyncio.gather(*(streamed(p) for p in prompts))
        w = await asyncio.gather(*(one(p) for p in prompts))
        return s, w

    streams, wholes = asyncio.run(go())
    assert streams == wholes
    assert wholes == offline_texts(offline, prompts, max_tokens=16)
    assert len(set(wholes)) > 1
