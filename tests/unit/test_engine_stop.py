"""Stop strings, stop tokens and length limits, streamed and not (tiny preset, greedy)."""
from __future__ import annotations

import pytest

from backend import LLM, SamplingParams
from backend.outputs import CONTEXT_TOKENS, decode_delta
from tests.conftest import model_dir

GREEDY = dict(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def llm():
    return LLM(model_dir("tiny"), num_kv_blocks=128, num_threads=1)


def stream(llm, prompt_ids, params):
    """Run one streamed request; return the decoded text pieces and the deltas."""
    eng, tok = llm.engine, llm.tokenizer
    eng.add_request("s", prompt_ids, params, stream=True)
    pieces, deltas = [], []
    while eng.has_unfinished():
        for d in eng.step():
            deltas.append(d)
            pieces.append(decode_delta(tok, d.window_ids, d.num_sent, final=d.finished,
                                       max_chars=d.max_chars, skip_special_tokens=True))
    return pieces, deltas


def boundary_stop(tok, ids: list[int], text: str) -> tuple[str, int]:
    """A stop string taken from the text across a token boundary, first occurring there."""
    for i in range(2, len(ids) - 1):
        head = tok.decode(ids[:i])
        b = len(head)
        if not text.startswith(head) or b < 2:
            continue
        stop = text[b - 2:b + 2]
        if len(stop) == 4 and text.find(stop) == b - 2:
            return stop, b - 2
    raise AssertionError(f"no usable token boundary in {text!r}")


@pytest.mark.parametrize("prompt", ["hello world", "The quick brown fox", "Once upon a time"])
def test_stop_string_across_tokens_is_cut_exactly_and_never_streamed(llm, prompt):
    tok = llm.tokenizer
    ids = tok.encode(prompt)
    free = llm.generate([ids], SamplingParams(**GREEDY))[0].outputs[0]
    stop, at = boundary_stop(tok, free.token_ids, free.text)
    params = SamplingParams(**GREEDY, stop=["\u2603 never", stop])
    out = llm.generate([ids], params)[0].outputs[0]
    assert out.text == free.text[:at] and out.finish_reason == "stop"
    assert free.token_ids[:len(out.token_ids)] == out.token_ids      # stopped right at the match
    pieces, deltas = stream(llm, ids, params)
    assert "".join(pieces) == out.text
    assert all(stop not in p for p in pieces)
    assert [t for d in deltas for t in d.new_token_ids] == out.token_ids
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop"
    # the final delta carries the held tokens and cuts its text right before the stop string
    assert deltas[-1].max_chars >= 0 and all(d.max_chars == -1 for d in deltas[:-1])


def test_streamed_text_equals_final_text_without_stop_strings(llm):
    tok = llm.tokenizer
    ids = tok.encode("Once upon a time")                 # its output begins with a partial character
    final = llm.generate([ids], SamplingParams(**GREEDY))[0].outputs[0]
    pieces, deltas = stream(llm, ids, SamplingParams(**GREEDY))
    assert "".join(pieces) == final.text == tok.decode(final.token_ids, skip_special_tokens=True)
    assert len(deltas) == 16 and all(len(d.new_token_ids) == 1 for d in deltas)
    assert all(len(d.window_ids) <= CONTEXT_TOKENS + 1 for d in deltas)      # short windows


def test_stop_token_ids_stop_and_keep_the_token_but_not_its_text(llm):
    tok = llm.tokenizer
    ids = tok.encode("hello world")
    free = llm.generate([ids], SamplingParams(**GREEDY))[0].outputs[0]
    stop_id = free.token_ids[3]                         # 'etween' after three '良好'
    out = llm.generate([ids], SamplingParams(**GREEDY, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == free.token_ids[:4] and out.finish_reason == "stop"
    assert out.text == tok.decode(free.token_ids[:3])
    pieces, _ = stream(llm, ids, SamplingParams(**GREEDY, stop_token_ids=[stop_id]))
    assert "".join(pieces) == out.text
    # min_tokens: no stop before it
    late = llm.generate([ids], SamplingParams(**GREEDY, stop_token_ids=[stop_id], min_tokens=8))[0].outputs[0]
    assert len(late.token_ids) > 4


def test_length_limits_max_tokens_and_context(llm):
    ids = llm.tokenizer.encode("hello world")
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    small = LLM(model_dir("tiny"), num_kv_blocks=8, block_size=4, num_threads=1)   # context = 32
    out = small.generate([ids], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0].outputs[0]
    assert len(ids) + len(out.token_ids) == 32 and out.finish_reason == "length"
