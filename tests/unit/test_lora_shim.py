"""The shim maps the OpenAI ``model`` field to a LoRA adapter (request parameter ``lora``), lists
adapters under /v1/models with their parent, and answers an unknown model with OpenAI's 404
(the official SDK against the app; the Triton side is the scripted client)."""
from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient

from client.fake_client import FakeLLMClient
from client.shim import ShimSettings, create_app
from client.shim.settings import build_parser, settings_from_args


@pytest.fixture
def setup():
    fake = FakeLLMClient()
    app = create_app(ShimSettings(model_name="tiny", lora_names=("ada8", "ada16")), client=fake)
    with TestClient(app) as http:
        yield fake, openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)


def test_model_names_the_adapter(setup):
    fake, sdk = setup
    sdk.chat.completions.create(model="ada8", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    sdk.completions.create(model="ada16", prompt="hi", max_tokens=4)
    sdk.completions.create(model="tiny", prompt="hi", max_tokens=4)
    assert [c["params"].get("lora") for c in fake.calls] == ["ada8", "ada16", None]


def test_models_list_and_unknown(setup):
    fake, sdk = setup
    cards = {m.id: m for m in sdk.models.list().data}
    assert set(cards) == {"tiny", "ada8", "ada16"}
    assert cards["ada8"].parent == "tiny" and not hasattr(cards["tiny"], "parent")
    assert sdk.models.retrieve("ada16").parent == "tiny"
    with pytest.raises(openai.NotFoundError) as err:
        sdk.completions.create(model="ada99", prompt="hi", max_tokens=4)
    assert err.value.code == "model_not_found" and not fake.calls


def test_lora_name_argument():
    args = build_parser().parse_args(["--lora-name", "a", "--lora-name", "b"])
    assert settings_from_args(args).lora_names == ("a", "b")


def test_responses_and_messages_name_adapters_too(setup):
    import anthropic

    fake, sdk = setup
    sdk.responses.create(model="ada16", input="hi", max_output_tokens=4)
    http = sdk._client                                  # the TestClient under the openai SDK
    claude = anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=http)
    claude.messages.create(model="ada8", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    claude.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert [c["params"].get("lora") for c in fake.calls] == ["ada16", "ada8", None]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="ada99", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
