"""The shim's SSE chunks: the per-choice template path (only the text encoded per chunk) makes the
same bytes as building each chunk's dict; one write per gRPC response carries the same bytes."""
from __future__ import annotations

import asyncio
import json
import random

import pytest

from client.shim import format as fmt
from client.shim.format import Tally
from client.shim.generation import events as _events
from client.wire import Chunk

ODD = ['"', "\\", "\n", "\t", "\x00", "\x1f", "\u2028", "é", "日本", "🙂", "</script>", "\ue000", "{}", ","]


def dict_event(tally: Tally, index: int, text: str) -> str:
    """What chunk_events made before the template: the chunk's dict through ``_event``."""
    if tally.chat:
        choice = {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
    else:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
    return tally._event([choice])


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("include_usage", [True, False])
def test_template_chunks_are_the_dict_chunks_byte_for_byte(chat, include_usage):
    rng = random.Random(7)
    tally = Tally(chat=chat, request_id="chatcmpl-\"x\\", model="m/ü \"q\"", num_choices=3,
                  logprobs=False, include_usage=include_usage)
    for _ in range(300):
        text = "".join(rng.choice(ODD + ["ab", " ", "x"]) for _ in range(rng.randint(1, 6)))
        index = rng.randrange(3)
        events = tally.chunk_events(index, 0, Chunk(index=index, text=text, completion_tokens=1))
        assert events == [dict_event(tally, index, text)]
        choice = json.loads(events[0][6:])["choices"][0]
        assert (choice["delta"]["content"] if chat else choice["text"]) == text
    assert set(tally._templates) == {0, 1, 2} and all(tally._templates.values())


def test_a_model_name_holding_the_mark_falls_back_to_the_dict_path():
    tally = Tally(chat=True, request_id="r", model=fmt._MARK, num_choices=1, logprobs=False)
    (ev,) = tally.chunk_events(0, 0, Chunk(text="hi"))
    assert ev == dict_event(tally, 0, "hi") and tally._templates == {0: None}


class Items:
    def __init__(self, chunks):
        self.chunks = list(chunks)
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.chunks:
            raise StopAsyncIteration
        c = self.chunks.pop(0)
        return c.index, 0, c

    async def aclose(self):
        self.closed = True


class FixedTime:
    """Both tallies see the same clock (created, e2e)."""
    @staticmethod
    def time():
        return 1700000000.0

    @staticmethod
    def monotonic():
        return 5.0


@pytest.fixture(autouse=True)
def fixed_time(monkeypatch):
    monkeypatch.setattr(fmt, "time", FixedTime)


def sse_bodies(chunks, **tally_kw):
    """The SSE body's writes and, separately, each event the old per-event loop yielded."""
    async def run():
        tally = Tally(request_id="r", model="m", **tally_kw)
        items = Items(chunks[1:])
        first = (chunks[0].index, 0, chunks[0])
        return [w async for w in _events(first, items, tally, {})], items.closed, tally

    writes, closed, tally = asyncio.run(run())
    old = Tally(request_id="r", model="m", **tally_kw)
    events = old.start_events()
    for c in chunks:
        events += old.chunk_events(c.index, 0, c)
    events += old.end_events() if old.done else []
    return writes, events, closed


@pytest.mark.parametrize("include_usage", [True, False])
def test_one_write_per_response_carries_the_old_event_bytes(include_usage):
    chunks = [Chunk(index=i % 2, text=t, completion_tokens=1, prompt_tokens=3) for i, t in
              enumerate(["a", "b\"", "", "日"])]
    chunks += [Chunk(index=0, text="z", finish_reason="stop", completion_tokens=2),
               Chunk(index=1, text="", finish_reason="length", completion_tokens=2)]
    writes, events, closed = sse_bodies(chunks, chat=True, num_choices=2, logprobs=False,
                                        include_usage=include_usage)
    assert "".join(writes) == "".join(events) and closed
    assert writes[0].count("data: ") == 3                # two role chunks and the first content
    assert writes[-1].endswith("data: [DONE]\n\n") and '"finish_reason":"length"' in writes[-1]
    assert len(writes) == 5                              # "" made no write
    assert writes[-1].startswith('data: {"id":"r"') and writes[-1].count("data: ") == 2 + include_usage


def test_a_stream_that_ends_unfinished_ends_with_the_error_event():
    writes, events, closed = sse_bodies([Chunk(text="a"), Chunk(text="b")], chat=False, num_choices=1,
                                        logprobs=False)
    assert "".join(writes).startswith("".join(events)) and '"error"' in writes[-1] and closed
    assert "[DONE]" not in writes[-1]
