"""The chat's token counter (client/chat/tokens.py) and the chat's startup off the event loop's
way: the counter encodes with the Rust tokenizer's ``encode_batch``, which releases the GIL while
it works (its plain ``encode`` holds it), and must give the ids transformers' ``__call__`` gives;
the shim loads the counter and builds the chat routes in its startup, not on a tenant's first
message (parsing tokenizer.json and building FastAPI's route state hold the GIL)."""
from __future__ import annotations

import asyncio
import gc
import sys
import threading

import httpx
import pytest
from fastapi.testclient import TestClient

from client.chat.tokens import TokenCounter
from client.shim.app import create_app
from client.shim.settings import ShimSettings
from tests.unit.loop_helpers import loop_calls

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


def test_encoding_a_long_text_lets_other_threads_run(counter):
    """No thread is ever preempted under a 100 s switch interval, so this thread runs while the
    worker encodes (and sees it unfinished) only if the tokenizer lets go of the GIL; one that
    held it would let this thread in only once the worker had finished."""
    text = " ".join(f"word{i % 5000} answer" for i in range(100_000))    # ~1.3M characters
    started, seen, done = threading.Event(), [], []

    def work():
        started.set()
        counter.encode(text)
        done.append(True)

    old = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    worker = threading.Thread(target=work)
    try:
        worker.start()
        started.wait()
        seen.append(bool(done))
    finally:
        worker.join()
        sys.setswitchinterval(old)
    assert seen == [False] and done == [True]


def test_a_decoded_tail_fits_and_ends_the_text(counter):
    text = "héllo words 你好 " * 500
    tail = counter.tail(text, 50)
    assert text.endswith(tail) and 0 < len(counter.encode(tail)) <= 51
    assert counter.tail("short", 50) == "short"


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


def test_the_first_chat_request_after_startup_builds_nothing_on_the_loop(tmp_path):
    """Python calls made on the event loop's thread by the first chat request after startup, against
    the same request made again: FastAPI builds a router's route state (dependants, validators, ~15k
    calls, 25-40 ms) on the first request that reaches it, which the startup does instead; and the
    thread pool the routes hand SQLite to is started by then."""
    settings = ShimSettings(api_keys={"sk-a": "alice"}, chat_db_path=str(tmp_path / "chat.sqlite"))
    app = create_app(settings, client=NoServer())
    gc.unfreeze()

    async def scenario():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                         headers={"Authorization": "Bearer sk-a"}) as http:
                assert (await http.get("/health")).status_code == 200     # the client's own first use
                runs = [await loop_calls(lambda: http.post("/api/conversations", json={})) for _ in range(2)]
        return runs

    try:
        (first, r1), (again, r2) = asyncio.run(scenario())
    finally:
        gc.unfreeze()
    assert r1.status_code == r2.status_code == 201, r1.text
    assert first <= 2 * again, (first, again)
