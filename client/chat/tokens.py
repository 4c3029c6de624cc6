"""Token counts for the context policy (context.py): ``TokenCounter`` and its bounded cache.

Counts run on worker threads (context.py calls them through ``asyncio.to_thread``). Each message
is tokenized once: its count is cached under a 16-byte digest of its role and text, so the cache
never pins the (up to 200k-character) texts, and holds at most ``COUNT_CACHE_BYTES``.
"""
from __future__ import annotations

import hashlib
import pathlib
import threading
from collections import OrderedDict

PROJECT_TOKENIZER = pathlib.Path(__file__).resolve().parents[2] / "backend" / "assets" / "tokenizer"
COUNT_CACHE_BYTES = 8 * 1024 * 1024         # token counts kept, ~150 bytes an entry


class TokenCounter:
    """Counts prompt tokens the way the server will: the tokenizer's chat template, then encode.

    Without a tokenizer (none found) it estimates 1 token per 3 UTF-8 bytes plus 4 per message.
    """

    def __init__(self, tokenizer_dir: str | pathlib.Path | None = None):
        self.tokenizer = None
        for candidate in (tokenizer_dir, PROJECT_TOKENIZER):
            if candidate and (pathlib.Path(candidate) / "tokenizer.json").exists():
                from transformers import PreTrainedTokenizerFast

                self.tokenizer = PreTrainedTokenizerFast.from_pretrained(str(candidate))
                break
        self._counts = CountCache(COUNT_CACHE_BYTES)
        probe = [{"role": "user", "content": "x"}]
        self._generation_prompt = (self._render_tokens(probe, add_generation_prompt=True)
                                   - self._render_tokens(probe, add_generation_prompt=False))

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode())[::3]
        # The Rust tokenizer's encode_batch releases the GIL while it works; its plain encode holds
        # it throughout (~65 ms for a 100k-character reply: the shim's event loop stalled as long,
        # though the count ran on a worker thread). Same ids (tests/unit/test_chat_tokens.py).
        return self.tokenizer.backend_tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def tail(self, text: str, max_tokens: int) -> str:
        """The end of ``text`` that fits in ``max_tokens`` tokens."""
        if self.tokenizer is None:
            return text.encode()[-3 * max_tokens:].decode(errors="ignore")
        ids = self.encode(text)
        if len(ids) <= max_tokens:
            return text
        # decode_batch releases the GIL too (decode holds it, a few ms for a window's worth)
        return self.tokenizer.backend_tokenizer.decode_batch([ids[-max_tokens:]], skip_special_tokens=False)[0]

    def _render_tokens(self, messages: list[dict], add_generation_prompt: bool) -> int:
        if not messages:
            return self._generation_prompt if add_generation_prompt else 0
        if self.tokenizer is None:
            return sum(4 + len(m["content"].encode()) // 3 for m in messages) + (
                3 if add_generation_prompt else 0)
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        return len(self.encode(text))

    def message(self, role: str, content: str) -> int:
        """One message's tokens in the chat template (cached by a digest of role and text)."""
        key = _digest(role, content)
        n = self._counts.get(key)
        if n is None:
            n = self._render_tokens([{"role": role, "content": content}], False)
            self._counts.put(key, n)
        return n

    def text(self, text: str) -> int:
        """Plain text's tokens (cached like a message's)."""
        key = _digest("\0text", text)
        n = self._counts.get(key)
        if n is None:
            n = len(self.encode(text))
            self._counts.put(key, n)
        return n

    def count(self, messages: list[dict]) -> int:
        """Prompt tokens of ``messages`` with the generation prompt (per-message sums, cached)."""
        return sum(self.message(m["role"], m["content"]) for m in messages) + self._generation_prompt

    def count_exact(self, messages: list[dict]) -> int:
        return self._render_tokens(messages, True)


def _digest(role: str, content: str) -> bytes:
    h = hashlib.blake2b(role.encode(), digest_size=16)
    h.update(b"\0")
    h.update(content.encode("utf-8", "surrogatepass"))
    return h.digest()


class CountCache:
    """Token counts by 16-byte digest, least recently used out: bounded by bytes, and a cached
    count never pins the text it counts."""
    ENTRY_BYTES = 150          # digest + int + OrderedDict node, measured with sys.getsizeof

    def __init__(self, max_bytes: int):
        self.max_entries = max(1, max_bytes // self.ENTRY_BYTES)
        self._items: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()            # counts run on worker threads

    def get(self, key: bytes) -> int | None:
        with self._lock:
            n = self._items.get(key)
            if n is not None:
                self._items.move_to_end(key)
            return n

    def put(self, key: bytes, n: int) -> None:
        with self._lock:
            self._items[key] = n
            self._items.move_to_end(key)
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        return len(self._items) * self.ENTRY_BYTES
