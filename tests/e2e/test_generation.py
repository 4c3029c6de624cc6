"""Generation through a real tritonserver: streamed == non-streamed == offline, ensemble and engine."""
from __future__ import annotations

import json
import threading

import pytest
from transformers import AutoTokenizer

from backend.config import EngineArgs
from backend.llm import LLM
from backend.engine.admission import SamplingParams
from tests.conftest import E2E_ENGINE_OPTIONS
from tests.e2e.helpers import generate

pytestmark = pytest.mark.e2e

MAX_TOKENS = 24
PROMPTS = [
    "Hello, world! Tell me a story.",
    "你好，世界！今天天气怎么样？",
    "Emoji 😀🎉🚀 and naïve café",
    "  leading spaces  and   gaps ",
]
CHAT = [{"role": "system", "content": "你是一个有帮助的助手。"},
        {"role": "user", "content": "讲个笑话 😂, please!"}]


@pytest.fixture(scope="session")
def tokenizer(triton_server):
    return AutoTokenizer.from_pretrained(str(triton_server.model_dir))


@pytest.fixture(scope="session")
def offline(triton_server, tokenizer):
    """Offline greedy results for PROMPTS and CHAT (the reference every server path must match)."""
    llm = LLM(str(triton_server.model_dir), **EngineArgs.from_dict(E2E_ENGINE_OPTIONS).options())
    chat_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    outs = llm.generate(PROMPTS + [list(chat_ids)], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return {"prompts": outs[:-1], "chat": outs[-1], "chat_ids": list(chat_ids), "llm": llm}


def same_text(got: str, want: str) -> bool:
    """Byte-exact: multi-byte characters split across tokens and runs of invalid bytes included."""
    return got == want


def _check(res, expected, finals=1):
    assert res.error is None, res.error
    assert res.finals == finals, "FINAL must be sent exactly once"
    choice = res.choices[0]
    assert choice.ids == expected.outputs[0].token_ids
    assert same_text(choice.text, expected.outputs[0].text)
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert choice.final["completion_tokens"] == len(expected.outputs[0].token_ids)
    assert choice.final["prompt_tokens"] == len(expected.prompt_token_ids)


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_ensemble_stream_equals_nonstream_equals_offline(triton_server, offline, i):
    expected = offline["prompts"][i]
    streamed = generate(triton_server, "llm", text=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0.0)
    whole = generate(triton_server, "llm", text=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0.0,
                     stream=False)
    _check(streamed, expected)
    _check(whole, expected)
    assert whole.responses == 1
    assert streamed.responses > 1
    assert same_text(streamed.text, whole.text)


def test_ensemble_chat_messages(triton_server, offline):
    expected = offline["chat"]
    streamed = generate(triton_server, "llm", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0.0)
    whole = generate(triton_server, "llm", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0.0, stream=False)
    _check(streamed, expected)
    _check(whole, expected)
    metrics = streamed.choices[0].final["metrics"]
    assert set(metrics) == {"queue_time", "ttft", "num_preemptions"} and metrics["ttft"] > 0


@pytest.mark.parametrize("stream", [True, False])
def test_engine_direct_token_ids(triton_server, offline, tokenizer, stream):
    expected = offline["chat"]
    res = generate(triton_server, "engine", input_ids=offline["chat_ids"], tokenizer=tokenizer,
                   max_tokens=MAX_TOKENS, temperature=0.0, stream=stream)
    _check(res, expected)


def test_sixteen_concurrent_streams(triton_server, offline, tokenizer):
    """16 streams at once (ensemble and engine mixed), each identical to its offline result."""
    jobs = [("llm" if k % 2 == 0 else "engine", k % len(PROMPTS)) for k in range(16)]
    results: dict[int, object] = {}

    def run(k: int, model: str, i: int) -> None:
        if model == "llm":
            results[k] = generate(triton_server, "llm", text=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0.0)
        else:
            results[k] = generate(triton_server, "engine", input_ids=tokenizer.encode(PROMPTS[i]),
                                  tokenizer=tokenizer, max_tokens=MAX_TOKENS, temperature=0.0)

    threads = [threading.Thread(target=run, args=(k, m, i)) for k, (m, i) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for k, (_, i) in enumerate(jobs):
        _check(results[k], offline["prompts"][i])


def test_n_choices(triton_server):
    # n > 1 (sampled, seeded): one final per choice, FINAL once, every choice indexed.
    for stream in (True, False):
        res = generate(triton_server, "llm", text=PROMPTS[0], max_tokens=6, temperature=0.8, seed=7, n=3,
                       stream=stream)
        assert res.error is None and res.finals == 1
        assert sorted(res.choices) == [0, 1, 2]
        assert all(c.finish_reason in ("stop", "length") and c.text for c in res.choices.values())
        if not stream:
            assert res.responses == 3


def test_stop_string_cuts_streamed_and_whole_alike(triton_server, offline):
    """Always exercised: with ignore_eos the greedy answer is MAX_TOKENS tokens long, and the stop
    string is three clean characters from its middle, so finish_reason "stop" can only come from
    the stop string and the answer must end exactly before its first occurrence."""
    ref = offline["llm"].generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                               ignore_eos=True))[0].outputs[0]
    text = ref.text
    starts = [i for i in range(3, len(text) - 3) if "\ufffd" not in text[i:i + 3] and text[i:i + 3].strip()]
    assert starts, f"the greedy answer has no clean 3-character window to stop at: {text!r}"
    stop = text[starts[0]:starts[0] + 3]
    cut = text[:text.index(stop)]
    for stream in (True, False):
        res = generate(triton_server, "llm", text=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0,
                       ignore_eos=True, stop=json.dumps([stop]), stream=stream)
        assert res.error is None and res.finals == 1
        assert res.text == cut and res.finish_reason == "stop"
        assert res.choices[0].final["completion_tokens"] < len(ref.token_ids)


def test_logprobs_in_openai_shape(triton_server, offline):
    """One entry per generated token, exactly the offline greedy ids' bytes, in order."""
    from backend.serving.postprocess import TokenBytes

    expected = offline["prompts"][1].outputs[0]
    res = generate(triton_server, "llm", text=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0.0,
                   logprobs=True, top_logprobs=2)
    lps = res.choices[0].logprobs
    assert len(lps) == len(expected.token_ids)
    for lp in lps:
        assert set(lp) == {"token", "bytes", "logprob", "top_logprobs"}
        assert len(lp["top_logprobs"]) == 2
        assert lp["top_logprobs"][0]["bytes"] == lp["bytes"]          # greedy: the chosen is the best
        assert lp["logprob"] == pytest.approx(lp["top_logprobs"][0]["logprob"])
    token_bytes = TokenBytes(offline["llm"].tokenizer)
    assert [bytes(lp["bytes"]) for lp in lps] == [token_bytes(t) for t in expected.token_ids]
