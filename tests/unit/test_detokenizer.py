"""Stateless windowed detokenization: concatenated deltas equal decode(all ids), byte for byte."""
from __future__ import annotations

import random

import pytest
from transformers import PreTrainedTokenizerFast

from backend.outputs import decode_delta, window_start
from backend.tokenizer_train import TOKENIZER_DIR

TEXTS = [
    "你好，世界！今天天气很好，我们来讨论 KV Cache 的分页管理。",
    "rare 𝄞 bytes 🦩 and 👩‍💻 👨‍👩‍👧‍👦 🇨🇳 after  two spaces\tand a tab",
    " leading space and trailing space ",
    "mixed 中文 English 日本語 한국어 ελληνικά",
]


@pytest.fixture(scope="module")
def tok():
    return PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_DIR / "tokenizer.json"))


def stream(tok, ids: list[int], chunks: list[int]) -> str:
    """Emit ids in chunks of the given sizes, the way the engine and postprocessing do."""
    out, sent, pos = [], 0, 0
    for i, size in enumerate(chunks):
        end = min(len(ids), pos + size)
        final = end == len(ids)
        start = window_start(sent)
        out.append(decode_delta(tok, ids[start:end], sent - start, final=final))
        sent = pos = end
        if final:
            break
    return "".join(out)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("seed", range(4))
def test_concatenated_deltas_equal_full_decode(tok, text, seed):
    ids = tok.encode(text, add_special_tokens=False)
    rng = random.Random(seed)
    chunks = [rng.choice([1, 1, 1, 2, 3]) for _ in range(len(ids))]
    assert stream(tok, ids, chunks) == tok.decode(ids)


def test_incomplete_character_is_held_until_complete(tok):
    ids = tok.encode("𝄞", add_special_tokens=False)
    assert len(ids) > 1
    first = decode_delta(tok, ids[:1], 0)
    assert first == ""  # a lone partial character is held back
    assert decode_delta(tok, ids, 0) == "𝄞"


def test_a_run_of_invalid_bytes_streams_exactly(tok):
    """Lone continuation bytes decode to permanent U+FFFD: a long run must not be swallowed."""
    text_ids = tok.encode("50 合并", add_special_tokens=False)
    lone = tok.convert_tokens_to_ids("\u00a3")  # byte 0xA3 alone, never valid
    ids = text_ids[:1] + [lone] * 7 + text_ids[1:] + [lone] * 2
    assert tok.decode(ids).count("\ufffd") == 9
    for chunk in (1, 2, 3):
        assert stream(tok, ids, [chunk] * len(ids)) == tok.decode(ids)


def test_final_keeps_trailing_replacement_like_full_decode(tok):
    ids = tok.encode("ab𝄞", add_special_tokens=False)[:-1]  # ends mid-character
    assert stream(tok, ids, [1] * len(ids)) == tok.decode(ids)


def test_max_chars_cuts_the_delta(tok):
    ids = tok.encode("hello world", add_special_tokens=False)
    assert decode_delta(tok, ids, 0, final=True, max_chars=5) == "hello"


def test_special_tokens_are_skipped(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("done", add_special_tokens=False) + [eos]
    assert decode_delta(tok, ids, 0, final=True) == "done"


@pytest.mark.parametrize("seed", range(6))
def test_random_token_soup_streams_exactly(tok, seed):
    """Arbitrary ids (byte tokens, partial characters, specials) as a random model emits them."""
    rng = random.Random(seed)
    vocab = tok.backend_tokenizer.get_vocab_size()
    lone_bytes = list(range(3, 260))  # single-byte tokens sit at the start of the vocabulary
    ids = [rng.choice(lone_bytes) if rng.random() < 0.5 else rng.randrange(vocab) for _ in range(80)]
    chunks = [rng.choice([1, 1, 2, 4]) for _ in range(len(ids))]
    assert stream(tok, ids, chunks) == tok.decode(ids, clean_up_tokenization_spaces=False)


def _fragments(tok) -> list[int]:
    """Tokens whose bytes are not whole UTF-8 characters (lead bytes with part of their tail,
    continuation bytes, both), as byte-level BPE merges them from text split mid-character."""
    ids = []
    for i in range(tok.backend_tokenizer.get_vocab_size()):
        text = tok.decode([i])
        if "\ufffd" in text and len(tok.convert_ids_to_tokens(i)) > 1:
            ids.append(i)
    return ids


def test_a_character_completed_by_a_token_that_brings_invalid_bytes(tok):
    """e9 80 | ae b5 | ae b5 | ae b5: the first token's U+FFFD becomes "逮" one token later; three
    tokens after it the text still ends in U+FFFD (the lone b5 / ae bytes), which once made the
    stream emit U+FFFD in place of "逮" (a CI run of the speculative-serving e2e test)."""
    lead, tail = tok.convert_tokens_to_ids("\u00e9\u0122"), tok.convert_tokens_to_ids("\u00ae\u00b5")
    ids = tok.encode(" Hi", add_special_tokens=False) + [lead] + [tail] * 5 + tok.encode("ab", add_special_tokens=False)
    assert tok.decode([lead, tail]).startswith("逮")
    for size in (1, 2, 3, 4, 5):
        for first in range(1, size + 1):
            assert stream(tok, ids, [first] + [size] * len(ids)) == tok.decode(ids)


@pytest.mark.parametrize("seed", range(8))
def test_random_partial_character_soup_streams_exactly(tok, seed):
    """Sequences made mostly of partial-character tokens (where completions and invalid bytes
    interleave), streamed in random chunk sizes, as speculative decoding delivers them."""
    rng = random.Random(seed)
    frags = _fragments(tok)
    assert len(frags) > 50
    words = tok.encode(" 你好 world 🦩", add_special_tokens=False)
    ids = [rng.choice(frags) if rng.random() < 0.8 else rng.choice(words) for _ in range(120)]
    for _ in range(4):
        chunks = [rng.choice([1, 2, 3, 5, 8]) for _ in range(len(ids))]
        assert stream(tok, ids, chunks) == tok.decode(ids, clean_up_tokenization_spaces=False)
