"""Slow grammar compiles never freeze the engine (issue 30), through the full stack: the real
model (SmolLM2's 49k vocabulary is what makes these regexes slow to compile), tritonserver, the
shim, the OpenAI SDK.

While 8 requests with distinct slow-to-compile regexes arrive over 4 s, an unconstrained stream's
largest gap between chunks stays under 0.5 s, and every constrained request gets an answer: 200
(compiled within the budget) or 400 naming ``guided_regex`` (not within it). Each regex unrolls
into 2,000 grammar positions of ``.``, the most the caps allow (backend/structured/caps.py):
seconds of compile per regex here, and at least the 5 s budget's worth of work in total on any
host, so the compile worker is busy for the whole window. The unconstrained side streams
back-to-back for as long as any constrained request is unanswered, so every gap it measures lies
inside that window whatever the host's speed.

The same scenario first runs with 8 unconstrained requests in place of the regexes: a host too
busy to stream under 0.5 s gaps even then (other jobs on its cores) cannot show the bound either
way, and the test is skipped with both measurements rather than passed or failed on noise. The
pair runs twice at most: a freeze fails both tries, one burst of another job's CPU does not.
"""
from __future__ import annotations

import asyncio
import time

import openai
import pytest

from tests.e2e.shim_fixtures import KEY, start_shim, stop_shim

pytestmark = pytest.mark.e2e
pytest.importorskip("xgrammar")

MODEL = "tiny"
CONSTRAINED = 8
ARRIVAL_SPAN_S = 4.0
MAX_GAP_S = 0.5
CHAT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


def slow_regex(i: int) -> str:
    """Distinct per request (no cache hits), at the caps: 100-wide `.` runs, 20 of them."""
    return f"(.{{0,100}}{'xyzw'[i % 4]}){{20}}{i}"


@pytest.fixture(scope="module")
def shim_url(real_server, tmp_path_factory):
    s = start_shim(real_server, tmp_path_factory.mktemp("shim-no-freeze"))
    yield s.url
    stop_shim(s.proc)


async def _stream_until(client: openai.AsyncOpenAI, done: asyncio.Event, gaps: list[float],
                        started: asyncio.Event) -> int:
    """Unconstrained streams, one after another, until ``done``; the gaps between chunks of each."""
    chunks = 0
    while not done.is_set():
        stream = await client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=300, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True})
        last = None
        async for _ in stream:
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last, chunks = now, chunks + 1
            if chunks >= 3:
                started.set()
            if done.is_set():
                break
        await stream.close()
    return chunks


async def _constrained(client: openai.AsyncOpenAI, i: int, grammar: bool) -> tuple[int, str | None]:
    try:
        await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0.0,
                                             extra_body={"guided_regex": slow_regex(i)} if grammar else {})
        return 200, None
    except openai.BadRequestError as exc:
        return exc.status_code, (exc.body or {}).get("param")


def _scenario(url: str, grammar: bool) -> tuple[list, list[float]]:
    """8 requests (slow regexes, or none) over 4 s beside the streams: their answers, the gaps."""
    async def run():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        done, started, gaps = asyncio.Event(), asyncio.Event(), []
        streamer = asyncio.create_task(_stream_until(client, done, gaps, started))
        await asyncio.wait_for(started.wait(), 120)
        gaps.clear()                            # only the gaps while the requests arrive and run
        asks = []
        for i in range(CONSTRAINED):
            asks.append(asyncio.create_task(_constrained(client, i, grammar)))
            await asyncio.sleep(ARRIVAL_SPAN_S / CONSTRAINED)
        answers = await asyncio.gather(*asks)
        done.set()
        await streamer
        await client.close()
        return answers, list(gaps)

    return asyncio.run(run())


def test_slow_grammars_do_not_stall_an_unconstrained_stream(shim_url):
    # Two tries at most: a freeze (a compile on the engine's path) fails both, while one burst of
    # another job's CPU on a loaded 2-core host (CI beside a burner) must not decide the result.
    tries = []
    for _ in range(2):
        _, base_gaps = _scenario(shim_url, grammar=False)
        answers, gaps = _scenario(shim_url, grammar=True)
        print(f"baseline: {len(base_gaps)} gaps, largest {max(base_gaps):.3f} s; with slow grammars: "
              f"answers {answers}, {len(gaps)} gaps, largest {max(gaps):.3f} s")
        assert all(a in ((200, None), (400, "guided_regex")) for a in answers), answers
        assert len(gaps) >= 8                       # >= 4 s of stream at under 0.5 s a chunk
        tries.append((max(base_gaps), max(gaps), sorted(gaps)[-5:]))
        if max(base_gaps) < MAX_GAP_S and max(gaps) < MAX_GAP_S:
            return
    if all(base >= MAX_GAP_S for base, _, _ in tries):
        pytest.skip(f"this host streams with {[round(b, 2) for b, _, _ in tries]} s gaps without any "
                    f"grammar (busy cores), so the {MAX_GAP_S} s bound cannot be shown; with the slow "
                    f"grammars the largest gaps were {[round(g, 2) for _, g, _ in tries]} s")
    pytest.fail(f"an unconstrained stream stalled past {MAX_GAP_S} s while grammars compiled "
                f"(baseline, with grammars, the five largest gaps): {tries}")
