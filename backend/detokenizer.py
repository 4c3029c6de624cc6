"""Stateless incremental detokenization over a short window of token ids.

Each streamed response carries ``window_ids`` = a few already-sent tokens for context followed by
the new ones, and ``num_sent`` = how many of the window were already sent. The delta is::

    emitted(k) = decode(window[:k]) without a trailing U+FFFD (an incomplete character)
    delta      = emitted(len(window))[len(emitted(num_sent)):]

Both decodes start at the same token, so whatever the first token does to the text (a partial
character, a stripped leading space) cancels out. On the final response a trailing U+FFFD is kept,
since decode(all ids) keeps it too. The engine and the postprocessing model call the same
functions, so a stop-string cut computed by the engine lands on the same characters.
"""
from __future__ import annotations

from typing import Any

# A character is at most 4 bytes, so 4 tokens before the first held-back token always start
# before it; one more for a leading-space quirk of the window's first token.
CONTEXT_TOKENS = 5
REPLACEMENT = "\ufffd"


def window_start(num_emitted: int) -> int:
    """Index of the first token of the window for a sequence whose first num_emitted tokens were sent."""
    return max(0, num_emitted - CONTEXT_TOKENS)


def _decode(tokenizer: Any, ids: list[int], skip_special_tokens: bool) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                            clean_up_tokenization_spaces=False)


def _emitted(tokenizer: Any, ids: list[int], final: bool, skip_special_tokens: bool) -> str:
    text = _decode(tokenizer, ids, skip_special_tokens)
    return text if final else text.rstrip(REPLACEMENT)


def decode_delta(tokenizer: Any, window_ids: list[int], num_sent: int, *, final: bool = False,
                 max_chars: int = -1, skip_special_tokens: bool = True) -> str:
    """Text of window_ids[num_sent:] given window_ids[:num_sent] was already emitted."""
    before = _emitted(tokenizer, window_ids[:num_sent], False, skip_special_tokens)
    after = _emitted(tokenizer, window_ids, final, skip_special_tokens)
    delta = after[len(before):]
    return delta if max_chars < 0 else delta[:max_chars]
