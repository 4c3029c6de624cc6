"""Stateless incremental detokenization over a short window of token ids.

Each streamed response carries ``window_ids`` = a few already-sent tokens for context followed by
the new ones, and ``num_sent`` = how many of the window were already sent. The delta is::

    emitted(k) = decode(window[:j]) for the largest j in [k - 3, k] whose text does not end in
                 U+FFFD (an incomplete character), else the longest common prefix of
                 decode(window[:j]) over j in [k - 3, k]
    delta      = emitted(len(window))[len(emitted(num_sent)):]

Holding back whole tokens, at most three, rather than trailing U+FFFD characters matters: invalid
bytes make permanent U+FFFD, and a run of them must not be held forever. A UTF-8 character has at
most 4 bytes, so three tokens (three bytes or more) after window[:k - 3] whatever character its
text ended in is settled: completed (then the later decodes no longer agree on that U+FFFD and the
common prefix stops before it) or invalid for good (then all four agree and it is emitted). Taking
decode(window[:k - 3]) itself there would emit the U+FFFD of a character that the next tokens
complete (bytes e9 80 | ae b5 | ae b5 | ae b5: "\ufffd" then "逮\ufffd..."), and the stream would
no longer equal decode(all ids).

Both decodes start at the same token, so whatever the first token does to the text (a partial
character, a stripped leading space) cancels out. On the final response a trailing U+FFFD is kept,
since decode(all ids) keeps it too. The engine and the postprocessing model call the same
functions, so a stop-string cut computed by the engine lands on the same characters.
"""
from __future__ import annotations

import os
from typing import Any

# At most MAX_HELD_TOKENS tokens are ever held back; the window reaches further back than that so
# both decodes share a clean start (a character is at most 4 bytes).
MAX_HELD_TOKENS = 3
CONTEXT_TOKENS = 6
REPLACEMENT = "\ufffd"


def window_start(num_emitted: int) -> int:
    """Index of the first token of the window for a sequence whose first num_emitted tokens were sent."""
    return max(0, num_emitted - CONTEXT_TOKENS)


def _decode(tokenizer: Any, ids: list[int], skip_special_tokens: bool) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                            clean_up_tokenization_spaces=False)


def _emitted(tokenizer: Any, ids: list[int], final: bool, skip_special_tokens: bool) -> str:
    text = _decode(tokenizer, ids, skip_special_tokens)
    if final or not text.endswith(REPLACEMENT):
        return text
    texts = [text]
    for cut in range(1, min(MAX_HELD_TOKENS, len(ids)) + 1):
        text = _decode(tokenizer, ids[:len(ids) - cut], skip_special_tokens)
        if not text.endswith(REPLACEMENT):
            return text
        texts.append(text)
    return os.path.commonprefix(texts)


def decode_delta(tokenizer: Any, window_ids: list[int], num_sent: int, *, final: bool = False,
                 max_chars: int = -1, skip_special_tokens: bool = True) -> str:
    """Text of window_ids[num_sent:] given window_ids[:num_sent] was already emitted."""
    before = _emitted(tokenizer, window_ids[:num_sent], False, skip_special_tokens)
    after = _emitted(tokenizer, window_ids, final, skip_special_tokens)
    delta = after[len(before):]
    return delta if max_chars < 0 else delta[:max_chars]
