"""The default model (SmolLM2-135M-Instruct, imported from GGUF) served end to end: greedy answers
through the OpenAI shim, asked with the official ``openai`` SDK, equal transformers' greedy
``generate`` on the same checkpoint directory (fp32), token for token. That covers the chat
template, tokenization, the imported weights and EOS handling (generation_config.json) at once.
"""
from __future__ import annotations

import openai
import pytest

from backend.config import EngineConfig
from backend.context import context_window_for
from tests.conftest import REAL_CONTEXT_WINDOW
from tests.e2e.shim_fixtures import KEY, start_shim, stop_shim

pytestmark = pytest.mark.e2e

SERVED = "smollm2"
MAX_TOKENS = 24
# Answers of both kinds: some end on <|im_end|> within MAX_TOKENS (EOS), some run to the limit.
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Translate 'good morning' into French.",
    "Give me three tips for staying healthy.",
    "Write a haiku about the sea.",
    "Who wrote Romeo and Juliet?",
    "Explain photosynthesis in one sentence.",
    "Name a primary color.",
]
TEXT_PROMPT = "The three largest planets of the solar system are"


@pytest.fixture(scope="module")
def hf():
    """transformers' own tokenizer + model on models/default (fp32), and its greedy answers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from backend.default_model import ensure_default_model

    path = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = set(model.generation_config.eos_token_id)

    def greedy(ids: list[int]) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
        new = out[0, len(ids):].tolist()
        return new[: next((i + 1 for i, t in enumerate(new) if t in eos), len(new))]

    chats = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                     return_dict=False) for p in CHAT_PROMPTS]
    return {"tok": tok, "eos": eos, "chat": [greedy(ids) for ids in chats],
            "text": greedy(tok.encode(TEXT_PROMPT))}


@pytest.fixture(scope="module")
def sdk(real_server, tmp_path_factory):
    shim = start_shim(real_server, tmp_path_factory.mktemp("real-shim"), extra_args=("--model-name", SERVED))
    yield openai.OpenAI(base_url=shim.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    stop_shim(shim.proc)


def _expect(hf, ids: list[int]) -> tuple[str, str]:
    """(text, finish_reason) the server must answer for transformers' greedy ids."""
    ended = bool(ids) and ids[-1] in hf["eos"]
    return hf["tok"].decode(ids, skip_special_tokens=True), "stop" if ended else "length"


def test_chat_greedy_equals_transformers_token_for_token(sdk, hf):
    tok = hf["tok"]
    assert sum(ids[-1] in hf["eos"] for ids in hf["chat"]) >= 2       # EOS handling is exercised
    for prompt, ids in zip(CHAT_PROMPTS, hf["chat"]):
        r = sdk.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": prompt}],
                                        max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True)
        text, finish = _expect(hf, ids)
        choice = r.choices[0]
        assert (choice.message.content, choice.finish_reason) == (text, finish), prompt
        # Token for token: one logprobs entry per generated token, each the same token's bytes.
        content = choice.logprobs.content
        shown = [i for i in ids if i not in hf["eos"]]
        assert r.usage.completion_tokens == len(ids), prompt
        assert [bytes(c.bytes) for c in content[: len(shown)]] == \
            [tok.decode([i]).encode() for i in shown], prompt


def test_completion_greedy_equals_transformers(sdk, hf):
    ids = hf["text"]
    r = sdk.completions.create(model=SERVED, prompt=TEXT_PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
    assert (r.choices[0].text, r.choices[0].finish_reason) == _expect(hf, ids)
    assert r.usage.completion_tokens == len(ids)
    assert r.usage.prompt_tokens == len(hf["tok"].encode(TEXT_PROMPT))


def test_the_capital_of_france_is_paris(sdk):
    stream = sdk.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=MAX_TOKENS, temperature=0.0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert "Paris" in text


def test_context_window_is_the_config_clamped_to_the_kv_pool(sdk, real_model_dir):
    """The model's 8,192 tokens, clamped to what the test server's KV pool holds; and the serve
    default budget (1 GiB, triton_llm/cli.py) holds the whole 8,192 for SmolLM2 in fp32."""
    from triton_llm.cli import SERVE_KV_CACHE_MEMORY

    card = sdk.models.retrieve(SERVED)
    assert card.model_extra["max_model_len"] == REAL_CONTEXT_WINDOW
    assert context_window_for(real_model_dir, EngineConfig(kv_cache_memory=SERVE_KV_CACHE_MEMORY)) == 8192
