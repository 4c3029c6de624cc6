"""Issue 17's first "Must show": through the full stack (tritonserver, the ``llm`` ensemble, gRPC),
greedy outputs with n-gram speculation on equal the offline engine's with it off, byte for byte.

32 mixed prompts go in at once: some repeat themselves (prompt lookup finds drafts that get
accepted), some do not (drafts get rejected and their KV slots rolled back), some carry a stop
string that lands mid-output, some ask for n = 2. The KV pool is small enough that the scheduler
preempts. The oracle is ``backend.LLM`` on the same checkpoint, fp32, speculation off, with a
roomy pool: any token speculation, preemption or serving changes shows up as a diff.
"""
from __future__ import annotations

import json
import time
import uuid

import pytest

from backend import LLM, SamplingParams
from tests.conftest import model_dir
from tests.e2e.helpers import Result, Stream, generate, make_inputs, metric, scrape
from tests.e2e.settle import settled

pytestmark = pytest.mark.e2e

MAX_TOKENS = 24
# Back-off off on purpose: the default disable_by_batch_size (8) would turn speculation off while
# 32 requests run, and min_accepted_tokens=0 keeps the non-repeating prompts speculating (and
# rejecting), so verification runs for every request, not only the lucky ones.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "disable_by_batch_size": 64, "min_accepted_tokens": 0}
# 32 blocks of 16 tokens for ~40 sequences of ~50 tokens each: the pool runs out mid-decode.
ENGINE_OPTIONS = {"num_kv_blocks": "32", "block_size": "16", "max_num_seqs": "64",
                  "max_num_batched_tokens": "256", "num_threads": "1",
                  "speculative_config": json.dumps(NGRAM)}

REPEATING = ["red green blue " * 8, "1 2 3 4 5 6 7 " * 5, "the cat sat on the mat. " * 5,
             "abc abd abe abf " * 6, "ping pong " * 10, "Lorem ipsum dolor sit amet, " * 4,
             "x = x + 1\n" * 8, "你好 世界 " * 6]
FREE = ["Hello, world! Tell me a story.", "Emoji 😀🎉🚀 and naïve café", "  leading spaces  and   gaps ",
        "What is the capital of France?", "Write a haiku about Triton.", "def add(a, b):",
        "Once upon a time", "Translate to German: good morning"]
PROMPTS = [(REPEATING if i % 2 else FREE)[i // 4 % 8] + ("" if i < 16 else f" #{i}") for i in range(32)]
N2 = {i for i in range(32) if i % 4 == 1}            # n = 2 (greedy: both choices equal the one)
STOPS = {i for i in range(32) if i % 4 == 2}          # a stop string taken from the middle of the output


def _params(i: int, stop: str | None) -> dict:
    p = dict(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    if i in N2:
        p["n"] = 2
    if stop is not None:
        p["stop"] = json.dumps([stop])
    return p


def _sampling(p: dict) -> SamplingParams:
    return SamplingParams(**{k: (json.loads(v) if k == "stop" else v) for k, v in p.items()})


def _stop_from(text: str) -> str:
    """Three whole characters (no U+FFFD of a split one), nearest the middle from the right."""
    mid = len(text) // 2
    for at in [*range(mid, len(text) - 2), *range(mid - 1, -1, -1)]:
        if "\ufffd" not in text[at:at + 3]:
            return text[at:at + 3]
    raise AssertionError(f"no stop string in {text!r}")


@pytest.fixture(scope="module")
def expected():
    """(params per prompt, offline answers) from the plain engine: stop strings are picked from its
    own full outputs, so they are sure to land inside the generated text."""
    oracle = LLM(str(model_dir("tiny")), num_kv_blocks=256)
    full = oracle.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    params = []
    for i, out in enumerate(full):
        params.append(_params(i, _stop_from(out.outputs[0].text) if i in STOPS else None))
    answers = [oracle.generate([PROMPTS[i]], _sampling(p))[0] for i, p in enumerate(params)]
    assert sum(a.outputs[0].finish_reason == "stop" for a in answers) >= len(STOPS) // 2
    return params, answers


@pytest.fixture(scope="module")
def spec_server():
    from backend.serving.launcher import TritonServer

    with TritonServer(model_dir("tiny"), engine_options=ENGINE_OPTIONS, quiet=True) as server:
        yield server


def _round_of_32(server, params, answers) -> dict:
    """All 32 requests in flight at once, each answer equal to the offline engine's; the counters'
    deltas over the round. The streams (gRPC channels) are opened first and the requests sent
    after, back to back."""
    before = scrape(server)
    streams, results = [], []
    for _ in PROMPTS:
        streams.append(Stream(server))
        results.append(Result(uuid.uuid4().hex))
    for s, res, prompt, p in zip(streams, results, PROMPTS, params):
        s.send("llm", make_inputs(text=prompt), res.request_id, p)
    t0 = time.monotonic()
    try:
        for s, res in zip(streams, results):
            s.collect(res, timeout=max(5.0, 600 - (time.monotonic() - t0)))     # generous: loaded CI
    finally:
        for s in streams:
            s.close()
    for i, (res, want) in enumerate(zip(results, answers)):
        assert res.error is None and res.finals == 1, (i, res)
        assert sorted(res.choices) == list(range(len(want.outputs))), i
        for k, w in enumerate(want.outputs):
            got = res.choices[k]
            assert (got.text.encode(), got.ids, got.finish_reason) == (w.text.encode(), w.token_ids,
                                                                       w.finish_reason), (i, k, PROMPTS[i])
            assert got.final["completion_tokens"] == len(w.token_ids)
    # the gauges and counters are polled (every 0.1 s), the counters after the gauges: wait for the
    # idle, empty pool AND every counter written (settled), or the deltas can still read 0
    after = settled(lambda: scrape(server), ready=lambda m: metric(m, "llm_num_requests_running") == 0
                    and metric(m, "llm_kv_cache_usage_ratio") == 0.0)
    return {name: metric(after, name) - metric(before, name) for name in (
        "llm_num_preemptions_total", "llm_spec_decode_num_draft_tokens_total",
        "llm_spec_decode_num_accepted_tokens_total")}


def test_greedy_with_ngram_speculation_equals_plain_offline(spec_server, expected):
    params, answers = expected
    # The pool (32 blocks of 16) holds far fewer than the 32 requests' tokens, so it preempts when they overlap; on a
    # loaded host the first can finish before the last is admitted. Every round checks every answer;
    # rounds repeat (at most 4) until one of them preempted: the state is reached, not raced.
    deltas = []
    for _ in range(4):
        deltas.append(_round_of_32(spec_server, params, answers))
        if deltas[-1]["llm_num_preemptions_total"] > 0:
            break
    delta = deltas[-1]
    assert delta["llm_num_preemptions_total"] > 0, deltas
    assert 0 < delta["llm_spec_decode_num_accepted_tokens_total"] < delta["llm_spec_decode_num_draft_tokens_total"], delta


def _settled_drafts(server) -> float:
    """The draft-token counter once no request runs and no llm_ value changed for a second (ten
    counter polls; a fixed 0.3 s could be less than one poll of a starved metrics thread)."""
    snap = settled(lambda: scrape(server), ready=lambda m: metric(m, "llm_num_requests_running") == 0)
    return metric(snap, "llm_spec_decode_num_draft_tokens_total")


def test_the_speculative_parameter_opts_one_request_out(spec_server, expected):
    """``speculative=false`` as a request parameter: the request drafts nothing, same answer."""
    params, answers = expected
    i = 3                                               # a repeating prompt: it drafts when allowed
    drafted = []
    for opt in ({"speculative": False}, {}):
        before = _settled_drafts(spec_server)          # earlier tests' drafts written (0.1 s poll)
        res = generate(spec_server, "llm", text=PROMPTS[i], **params[i], **opt)
        assert res.error is None and res.ids == answers[i].outputs[0].token_ids
        drafted.append(_settled_drafts(spec_server) - before)
    assert drafted[0] == 0 and drafted[1] > 0, drafted
