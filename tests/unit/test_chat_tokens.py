"""The chat's token counter (client/chat/tokens.py) off the event loop's way: it encodes with the
Rust tokenizer's own ``encode`` (which releases the GIL) and must give the ids transformers'
``__call__`` gives; the shim loads it in its startup, before the first request, not on a tenant's
first message (parsing tokenizer.json holds the GIL)."""
from __future__ import annotations

import gc

import pytest
from fastapi.testclient import TestClient

from client.chat.tokens import TokenCounter
from client.shim.app import create_app
from client.shim.settings import ShimSettings

TEXTS = ["", "hello", "héllo 你好 🙂 \t\n  spaced   out", "<|im_start|>user\nhi<|im_end|>\n" * 3,
         "answer words " * 2000, "".join(chr(c) for c in range(32, 2000)), "x" * 5000 + " y"]


@pytest.fixture(scope="module")
def counter():
    return TokenCounter()          # the project tokenizer (backend/assets/tokenizer)


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_encode_gives_the_ids_of_transformers_call(counter, text):
    assert counter.encode(text) == counter.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_rendered_chat_template_counts_as_transformers_would(counter):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo " * 500},
            {"role": "assistant", "content": "<|im_end|> inside a reply"}]
    text = counter.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert counter.count_exact(msgs) == len(counter.tokenizer(text, add_special_tokens=False)["input_ids"])


class NoServer:
    """A client that is never asked for a generation here."""
    async def generate(self, *a, **kw):       # pragma: no cover
        raise AssertionError("no generation in this test")
        yield

    async def is_ready(self, timeout: float = 2.0) -> bool:
        return True

    async def context_window(self, timeout: float = 5.0) -> int:
        return 2048

    async def close(self) -> None:
        return None


def test_the_shim_loads_the_counter_in_its_startup_and_freezes_what_it_holds():
    app = create_app(ShimSettings(), client=NoServer())
    gc.unfreeze()
    loaded = []
    real = TokenCounter.__init__

    def spy(self, *a, **kw):
        loaded.append(1)
        real(self, *a, **kw)

    TokenCounter.__init__ = spy
    try:
        with TestClient(app) as c:
            assert loaded == [1]                  # before any request
            assert gc.get_freeze_count() > 0
            r = c.post("/api/conversations", json={})
            conv = r.json()["id"]
            r = c.post(f"/api/conversations/{conv}/messages", json={"content": "hello there"})
            assert r.status_code == 201, r.text
            assert r.json()["context"]["prompt_tokens"] > 0
            assert loaded == [1]                  # the first message used the loaded one
    finally:
        TokenCounter.__init__ = real
        gc.unfreeze()
