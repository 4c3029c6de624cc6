"""The preprocessing model's prompt encode (the Rust tokenizer, called directly) gives the ids of
``tokenizer.encode`` (what offline code and the tests' oracle use) for every checkpoint kind."""
from __future__ import annotations

import pytest

from backend.serving.preprocess import Preprocessor
from tests.conftest import model_dir

TEXTS = ["Hello world", " leading space", "trailing space ", "two  spaces\n\nnew lines\t tab",
         "你好，世界 🙂 emoji", "a" * 300, "", "<|endoftext|> special token text <s></s>",
         "numbers 1234567890 3.14159", "café naïve résumé", "\u200b zero width"]


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2", "bench-15m"])
def test_encode_prompt_equals_tokenizer_encode(preset):
    pre = Preprocessor(model_dir(preset), context_window=4096)
    for text in TEXTS:
        ids = pre.encode_prompt(text)
        assert ids == [int(t) for t in pre.tokenizer.encode(text)], text
        assert all(type(t) is int for t in ids)
