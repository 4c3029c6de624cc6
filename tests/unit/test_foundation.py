"""Foundation: presets are reproducible and the tokenizer round-trips what users type."""
from __future__ import annotations

import hashlib
import json

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from backend.make_model import make_model
from backend.tokenizer_train import TOKENIZER_DIR

TEXTS = [
    "你好，世界！今天天气很好。",
    "emoji 😀🚀 and ZWJ 👩‍💻 👨‍👩‍👧‍👦 🏳️‍🌈 flags 🇨🇳🇯🇵 skin 👍🏽",
    "  leading spaces,\ttabs\t and\n\nnew lines   trailing  ",
    "mixed 中文 English 日本語 한국어 ελληνικά العربية",
    "",
]


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_make_model_same_seed_is_byte_identical(tmp_path):
    a = make_model("tiny", tmp_path / "a", seed=7)
    b = make_model("tiny", tmp_path / "b", seed=7)
    c = make_model("tiny", tmp_path / "c", seed=8)
    assert _sha(a / "model.safetensors") == _sha(b / "model.safetensors")
    assert _sha(a / "model.safetensors") != _sha(c / "model.safetensors")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).exists(), name


def test_checkpoint_layout_loads_in_transformers(tiny_qwen2_model):
    cfg = json.loads((tiny_qwen2_model / "config.json").read_text())
    assert cfg["model_type"] == "qwen2"
    gen = json.loads((tiny_qwen2_model / "generation_config.json").read_text())
    tok = PreTrainedTokenizerFast.from_pretrained(tiny_qwen2_model)
    assert gen["eos_token_id"][0] == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == "<|im_end|>"


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips_exactly(text):
    tok = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_DIR / "tokenizer.json"))
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, clean_up_tokenization_spaces=False) == text


def test_multibyte_characters_split_across_tokens():
    """The streaming tests depend on characters whose bytes span several tokens."""
    tok = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_DIR / "tokenizer.json"))
    ids = tok.encode("𝄞 🦩", add_special_tokens=False)  # not in the corpus: byte-level fallback
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)


def test_chat_template_is_chatml(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    msgs = [{"role": "system", "content": "你是助手"}, {"role": "user", "content": "hi 👋"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\n你是助手<|im_end|>\n<|im_start|>user\nhi 👋<|im_end|>\n<|im_start|>assistant\n"
