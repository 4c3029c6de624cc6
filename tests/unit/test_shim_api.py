"""The shim's OpenAI surface with the official SDK, against a scripted fake TritonLLMClient."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from client.errors import InternalError, InvalidRequestError, QueueFullError, UnavailableError
from client.fake_client import REPLY, FakeLLMClient
from client.shim import ShimSettings, create_app
from client.shim.background import BackgroundServer

KEY = "sk-test-1"


@pytest.fixture(scope="module")
def fake():
    return FakeLLMClient()


@pytest.fixture(scope="module")
def server(fake):
    settings = ShimSettings(model_name="tiny", api_keys={KEY: "acme", "sk-other": "globex"})
    with BackgroundServer(create_app(settings, client=fake)) as srv:
        yield srv


@pytest.fixture
def sdk(server, fake):
    fake.fail_before = fake.fail_after = fake.end_early = None
    fake.ready, fake.delay = True, 0.0
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def last_params(fake) -> dict:
    return fake.calls[-1]["params"]


def test_chat_non_streaming(sdk, fake):
    r = sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=5, temperature=0.0, seed=3)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == REPLY[:15] and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens == 1
    assert r.usage.total_tokens == 6 and r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.model_extra["triton_llm"]["ttft"] == 0.01
    p = last_params(fake)
    assert p == {"max_tokens": 5, "temperature": 0.0, "seed": 3, "tenant": "acme"}
    assert fake.calls[-1]["stream"] is False
    assert fake.calls[-1]["messages"] == [{"role": "user", "content": "hi"}]


def test_chat_streaming_shape_and_usage(sdk):
    stream = sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                         max_completion_tokens=4, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    first, *middle, finish, usage = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content for c in middle) == REPLY[:12]
    assert all(c.choices[0].finish_reason is None for c in middle)
    assert finish.choices[0].finish_reason == "length" and finish.choices[0].delta.content is None
    assert usage.choices == [] and usage.usage.completion_tokens == 4
    assert usage.usage.prompt_tokens_details.cached_tokens == 0
    assert usage.model_extra["triton_llm"]["queue_time"] == 0.001


def test_stream_ends_with_done(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line for line in r.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert "usage" not in json.loads(events[0][6:])          # only with include_usage


def test_n2_streaming_has_both_indices(sdk):
    chunks = list(sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                              n=2, max_tokens=3, stream=True))
    texts = {0: "", 1: ""}
    finishes = {}
    roles = []
    for c in chunks:
        for ch in c.choices:
            if ch.delta.role:
                roles.append(ch.index)
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert sorted(roles) == [0, 1] and texts == {0: REPLY[:9], 1: REPLY[:9]}
    assert finishes == {0: "length", 1: "length"}


def test_completions_stop_and_legacy_logprobs(sdk, fake):
    r = sdk.completions.create(model="tiny", prompt="say", stop="world", logprobs=2, max_tokens=50)
    assert r.object == "text_completion"
    assert r.choices[0].text == "Hello " and r.choices[0].finish_reason == "stop"
    lp = r.choices[0].logprobs
    assert lp.tokens == ["Hel", "lo ", ""] and lp.token_logprobs == [-0.5, -0.5, -0.5]
    assert lp.text_offset == [0, 3, 6] and lp.top_logprobs[0] == {"Hel": -0.5}
    assert last_params(fake)["stop"] == ["world"] and last_params(fake)["logprobs"] == 2


def test_completions_streaming_and_batched_prompts(sdk, fake):
    text = "".join(c.choices[0].text for c in sdk.completions.create(
        model="tiny", prompt="a", max_tokens=4, stream=True))
    assert text == REPLY[:12]
    r = sdk.completions.create(model="tiny", prompt=["a", "b"], n=2, max_tokens=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == 2


def test_chat_logprobs_shape(sdk):
    r = sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                    max_tokens=2, logprobs=True, top_logprobs=1)
    content = r.choices[0].logprobs.content
    assert [t.token for t in content] == ["Hel", "lo "]
    assert content[0].bytes == list(b"Hel") and content[0].top_logprobs[0].logprob == -0.5
    chunks = list(sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                              max_tokens=2, logprobs=True, top_logprobs=1, stream=True))
    streamed = [t.token for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.content]
    assert streamed == ["Hel", "lo "]


def test_sampling_fields_and_unknown_fields_pass(sdk, fake):
    sdk.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1, temperature=0.7,
        top_p=0.9, presence_penalty=0.1, frequency_penalty=0.2, stop=["a", "b"],
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "stop_token_ids": [2],
                    "some_future_field": {"x": 1}, "min_tokens": 1})
    assert last_params(fake) == {"max_tokens": 1, "temperature": 0.7, "top_p": 0.9, "presence_penalty": 0.1,
                                 "frequency_penalty": 0.2, "stop": ["a", "b"], "top_k": 5, "min_p": 0.05,
                                 "repetition_penalty": 1.1, "stop_token_ids": [2], "min_tokens": 1,
                                 "tenant": "acme"}


def test_omitted_max_tokens_is_not_sent(sdk, fake):
    sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert "max_tokens" not in last_params(fake)


def test_models(sdk, server):
    models = sdk.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert sdk.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as ei:
        sdk.models.retrieve("gpt-4")
    assert ei.value.body["code"] == "model_not_found"


def test_chat_tenants_are_salts(server, fake, sdk):
    other = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-other", max_retries=0)
    other.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert last_params(fake)["tenant"] == "globex"


def test_health_and_ready(server, fake, sdk):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").status_code == 200
    fake.ready = False
    r = httpx.get(server.url + "/ready")
    fake.ready = True
    assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"


# -- errors ----------------------------------------------------------------------------------------
def error_of(exc_info) -> dict:
    return exc_info.value.response.json()["error"]


def test_401(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as ei:
        bad.models.list()
    assert error_of(ei) == {"message": ei.value.body["message"], "type": "invalid_request_error",
                            "param": None, "code": "invalid_api_key"}
    r = httpx.post(server.url + "/v1/chat/completions", json={})
    assert r.status_code == 401                              # authentication comes before validation


def test_404_model(sdk):
    with pytest.raises(openai.NotFoundError) as ei:
        sdk.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert error_of(ei)["code"] == "model_not_found" and error_of(ei)["param"] == "model"


def test_400_from_server_tag_names_param(sdk, fake):
    fake.fail_before = InvalidRequestError("the prompt has 900 tokens but the context window is 512",
                                           param="text_input")
    with pytest.raises(openai.BadRequestError) as ei:
        sdk.completions.create(model="tiny", prompt="x" * 900)
    assert error_of(ei) == {"message": "the prompt has 900 tokens but the context window is 512",
                            "type": "invalid_request_error", "param": "prompt", "code": None}
    fake.fail_before = InvalidRequestError("max_tokens too big", param="max_tokens")
    with pytest.raises(openai.BadRequestError) as ei:
        sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                    max_completion_tokens=10 ** 6, stream=True)
    assert error_of(ei)["param"] == "max_completion_tokens"  # streaming: still a 400, not an SSE error


def test_400_validation_is_openai_shaped(server):
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": "nope"}, headers=h)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == "messages"
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                   headers={**h, "content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", content=b"[1]", headers=h)
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "n": "two"}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_429_with_retry_after(sdk, fake):
    fake.fail_before = QueueFullError("256 requests waiting", retry_after=7)
    with pytest.raises(openai.RateLimitError) as ei:
        sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], stream=True)
    assert ei.value.response.headers["retry-after"] == "7"
    assert error_of(ei)["code"] == "rate_limit_exceeded" and error_of(ei)["type"] == "rate_limit_error"


def test_503_and_500(sdk, fake):
    fake.fail_before = UnavailableError("Triton is not reachable")
    with pytest.raises(openai.InternalServerError) as ei:
        sdk.completions.create(model="tiny", prompt="x")
    assert ei.value.status_code == 503 and error_of(ei)["code"] == "service_unavailable"
    fake.fail_before = InternalError("engine crashed")
    with pytest.raises(openai.InternalServerError) as ei:
        sdk.completions.create(model="tiny", prompt="x")
    assert ei.value.status_code == 500


def test_failure_mid_stream_is_an_error_event_without_done(server, fake, sdk):
    fake.fail_after = (3, InternalError("engine crashed"))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    events = [e for e in r.text.split("\n\n") if e]
    assert r.status_code == 200 and len(events) > 2 and "[DONE]" not in r.text
    assert json.loads(events[-1][6:])["error"]["type"] == "server_error"


def test_failure_after_start_is_never_a_200(sdk, fake):
    fake.fail_after = (3, UnavailableError("the server aborted the request"))
    with pytest.raises(openai.APIError) as ei:           # streaming: the SDK raises on the error event
        list(sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                         stream=True))
    assert "aborted" in ei.value.message
    with pytest.raises(openai.InternalServerError) as ei:  # non-streaming: an error status
        sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert ei.value.status_code == 503


def test_stream_that_ends_without_finishing_is_an_error(server, fake, sdk):
    fake.end_early = 2
    with pytest.raises(openai.InternalServerError) as ei:
        sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert ei.value.status_code == 503
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert "[DONE]" not in r.text and '"error"' in r.text.split("\n\n")[-2]
